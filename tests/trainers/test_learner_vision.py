"""The learner on a vision-language policy (`tiny-vl`, real Qwen3-VL code, random weights):
log-probs recomputed with the pixels the engine sampled with, LoRA on the language model."""

import pytest
import torch

from agents.engines.base import POLICY, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.vision import images_of
from tests.agents.test_vision import looking, png
from trainers.config import TrainerConfig
from trainers.learner import Learner
from trainers.learning import TrainSample

GAP = 1e-3
"""Largest gap allowed between sampled and recomputed log-probs, in fp32."""


@pytest.fixture(scope="module")
def engine():
    engine = EmbeddedEngine("tiny-vl", threads=2)
    yield engine
    engine.close()


def sampled(engine, count=3, version=0):
    """Samples of the policy answering prompts with one or two screenshots."""
    prompts = [
        looking(png((96, 64))),
        looking(png((200, 150), (0, 0, 0)), png((64, 64), (9, 9, 9))),
        looking(png((160, 210), (255, 255, 255))),
    ]
    samples = []
    for index, messages in enumerate(prompts[:count]):
        completion = engine.generate(
            messages, None, SamplingParams(temperature=1.0, max_tokens=16, seed=index), POLICY
        )
        assert completion.policy_version == version
        samples.append(
            TrainSample(
                seq=index,
                prompt_ids=completion.prompt_token_ids,
                completion_ids=completion.completion_token_ids,
                rollout_logprobs=completion.completion_logprobs,
                advantages=(1.0 if index % 2 else -1.0,) * len(completion.completion_token_ids),
                policy_version=completion.policy_version,
                images=tuple(images_of(messages)),
            )
        )
    return samples


def gaps(learner, samples):
    with torch.no_grad():
        recomputed = learner._logprobs(samples)
    return torch.cat(
        [
            (r - torch.tensor(s.rollout_logprobs)).abs()
            for r, s in zip(recomputed, samples, strict=True)
        ]
    )


def test_recomputed_logprobs_match_the_sampled_ones_with_the_same_pixels(engine, tmp_path):
    learner = Learner("tiny-vl", TrainerConfig(lora_rank=4, lora_alpha=8, lr=5e-2), tmp_path)
    samples = sampled(engine)
    assert (
        sum(s.prompt_ids.count(engine.model.config.image_token_id) for s in samples)
        == 6 + 30 + 4 + 35
    )
    gap = gaps(learner, samples)
    assert gap.max() < GAP, f"mean {gap.mean():.2e} max {gap.max():.2e}"
    # the ids without their images are refused, not scored blind
    blind = [TrainSample(**{**s.__dict__, "images": ()}) for s in samples[:1]]
    with pytest.raises(ValueError, match="placeholders"):
        learner._logprobs(blind)


def test_lora_trains_the_language_model_only_and_the_engine_serves_it(engine, tmp_path):
    learner = Learner("tiny-vl", TrainerConfig(lora_rank=4, lora_alpha=8, lr=5e-2), tmp_path)
    trainable = [name for name, _ in learner._trainable()]
    assert trainable and all("language_model" in name and "lora_" in name for name in trainable)
    visual = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".visual." in n}
    metrics = learner.step(sampled(engine))
    assert metrics.logprob_gap_max < GAP
    assert all(
        torch.equal(p, visual[n]) for n, p in learner.model.named_parameters() if n in visual
    )
    engine.load_adapter(str(learner.save_adapter()), 1)
    samples = sampled(engine, count=2, version=1)
    learner.version = 1
    gap = gaps(learner, samples)
    assert gap.max() < GAP, f"mean {gap.mean():.2e} max {gap.max():.2e}"
