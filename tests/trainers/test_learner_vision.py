"""The learner on a vision-language policy (`tiny-vl`, real Qwen3-VL code, random weights):
log-probs recomputed with the pixels the engine sampled with, LoRA on the language model;
and the whole way from the browser's screenshots through the proxy and the store to it."""

import contextlib
import copy
import sqlite3

import pytest
import torch

from agents.engines.base import BASE, POLICY, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.rollout import run_episode
from agents.seats import ProxySeat
from agents.store import Store
from agents.trajectory import Judgement, Turn, TurnType
from agents.vision import digest, images_of
from tests.agents.serving import running
from tests.agents.test_vision import looking, png
from trainers.config import TrainerConfig
from trainers.hint_choice import HintChooser
from trainers.judge import teacher_logprobs, with_hint
from trainers.learner import Learner
from trainers.learning import TrainSample
from trainers.lora import select_lora_modules

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


class SentRecorder:
    """A seat that keeps a deep copy of the messages of every request it sends (what the
    client sent, to hold the store to), then sends it with the seat it wraps."""

    def __init__(self, seat):
        self.seat, self.sent = seat, []

    def open(self, session):
        self.seat.open(session)

    def reply(self, session_id, messages, tools, sampling):
        self.sent.append(copy.deepcopy(list(messages)))
        return self.seat.reply(session_id, messages, tools, sampling)

    def end(self, *args, **kwargs):
        self.seat.end(*args, **kwargs)


@pytest.mark.browser
def test_a_screenshot_episode_through_the_proxy_trains_on_exactly_what_the_policy_saw(
    engine, tmp_path
):
    """GUI-v0 on Chromium with `observation=screenshot`, played through the proxy with the
    official `openai` client (`ProxySeat`, as training rolls out): the store gives back the
    very screenshots the client sent, kept once each by sha256 outside the SQLite file, and
    the learner's log-probs of the stored turns, recomputed with those pixels, are the
    sampled ones."""
    from envs.gui.env import GUIEnv

    env = GUIEnv(tasks=["click-test"], observation="screenshot", max_turns=3)
    with contextlib.ExitStack() as stack:
        stack.callback(env.close)
        store = stack.enter_context(Store(tmp_path / "store.sqlite"))
        url, proxy = stack.enter_context(running(engine, store))
        seat = SentRecorder(
            stack.enter_context(contextlib.closing(ProxySeat(url, admin_key=proxy.admin_key)))
        )
        summary = run_episode(
            env,
            seat,
            env_id="clawgym/GUI-v0",
            seed=0,
            sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=5),
        )
        turns = store.session(summary.session_id).turns
        rows = [
            r[0] for r in sqlite3.connect(store.path).execute("SELECT prompt_messages FROM turns")
        ]
        files = {p.name for p in store.images.folder.iterdir()}
    assert len(turns) == len(seat.sent) == 3
    for turn, sent in zip(turns, seat.sent, strict=True):
        assert turn.prompt_messages == tuple(sent)  # the data URLs, character for character
        shots = images_of(sent)
        assert images_of(turn.prompt_messages) == shots and len(shots) == turn.index + 1
        assert all(shot.startswith(b"\x89PNG") for shot in shots)
        assert {digest(shot) + ".png" for shot in shots} <= files
    assert all("base64," not in row and "sha256:" in row for row in rows)

    learner = Learner("tiny-vl", TrainerConfig(lora_rank=4, lora_alpha=8), tmp_path / "learner")
    assert {turn.policy_version for turn in turns} == {learner.version}
    samples = [
        TrainSample(
            seq=turn.index,
            prompt_ids=turn.prompt_token_ids,
            completion_ids=turn.completion_token_ids,
            rollout_logprobs=turn.completion_logprobs,
            advantages=(0.0,) * len(turn.completion_token_ids),
            policy_version=turn.policy_version,
            images=tuple(images_of(turn.prompt_messages)),
        )
        for turn in turns
    ]
    gap = gaps(learner, samples)
    print(f"log-prob gap over {gap.numel()} tokens: mean {gap.mean():.2e} max {gap.max():.2e}")
    assert gap.max() < GAP, f"mean {gap.mean():.2e} max {gap.max():.2e}"


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


def test_vision_tower_flag_puts_lora_on_it_and_the_engine_serves_what_it_learned(tmp_path):
    engine = EmbeddedEngine("tiny-vl", threads=2)  # its own: the module's serves v1 by now
    try:
        tower_flag_round_trip(engine, tmp_path)
    finally:
        engine.close()


def tower_flag_round_trip(engine, tmp_path):
    config = TrainerConfig(lora_rank=4, lora_alpha=8, lr=5e-2, train_vision_tower=True)
    learner = Learner("tiny-vl", config, tmp_path)
    trainable = [name for name, _ in learner._trainable()]
    towers = {
        name.split(".visual.")[1].split(".lora_")[0] for name in trainable if ".visual." in name
    }
    # every linear layer of the tower: attention, MLP, the merger and the deepstack merger
    assert {"blocks.0.attn.qkv", "blocks.0.mlp.linear_fc2", "merger.linear_fc1"} <= towers
    assert "deepstack_merger_list.0.linear_fc2" in towers
    visual = {n: p.detach().clone() for n, p in learner._trainable() if ".visual." in n}
    learner.step(sampled(engine))
    changed = [n for n, p in learner._trainable() if n in visual and not torch.equal(p, visual[n])]
    assert changed, "no LoRA weight of the vision tower moved"
    engine.load_adapter(str(learner.save_adapter()), 1)
    samples = sampled(engine, count=2, version=1)
    learner.version = 1
    gap = gaps(learner, samples)
    assert gap.max() < GAP, f"mean {gap.mean():.2e} max {gap.max():.2e}"


def test_lora_targets_by_suffix_stay_in_the_language_model_unless_the_tower_is_asked_for():
    # Qwen2.5-VL's names: its vision MLP shares the language model's projection names
    linears = [
        "model.visual.blocks.0.attn.qkv",
        "model.visual.blocks.0.mlp.gate_proj",
        "model.visual.blocks.0.mlp.down_proj",
        "model.visual.merger.mlp.0",
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.0.mlp.gate_proj",
        "model.language_model.layers.0.mlp.down_proj",
        "lm_head",
    ]
    language = "model.language_model"
    assert select_lora_modules(linears, language, "lm_head", ["q_proj", "down_proj"], False) == [
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.0.mlp.down_proj",
    ]
    assert select_lora_modules(linears, language, "lm_head", ["q_proj"], True) == [
        "model.visual.blocks.0.attn.qkv",
        "model.visual.blocks.0.mlp.gate_proj",
        "model.visual.blocks.0.mlp.down_proj",
        "model.visual.merger.mlp.0",
        "model.language_model.layers.0.self_attn.q_proj",
    ]
    with pytest.raises(ValueError, match="target_modules"):
        select_lora_modules(linears, language, "lm_head", ["c_attn"], False)


def test_the_vision_tower_flag_on_a_text_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no vision tower"):
        Learner("tiny", TrainerConfig(train_vision_tower=True), tmp_path)


def screenshot_turn(engine, messages, judgement=None):
    """A stored-like turn of the base policy answering `messages` (images and text)."""
    completion = engine.generate(
        messages, None, SamplingParams(temperature=1.0, max_tokens=12, seed=3), BASE
    )
    return Turn(
        session_id="shot",
        index=0,
        turn_type=TurnType.MAIN,
        prompt_messages=tuple(messages),
        prompt_token_ids=completion.prompt_token_ids,
        completion_token_ids=completion.completion_token_ids,
        completion_logprobs=completion.completion_logprobs,
        completion=completion.message,
        policy_version=completion.policy_version,
        judgement=judgement,
    )


def test_the_teacher_of_a_screenshot_turn_sees_its_screenshots(engine, tmp_path):
    """OPD's teacher on a vision-language policy: the hinted prompt keeps the turn's images
    and the engine scores the student's tokens with their pixels; the learner's own pass
    over the same hinted prompt and pixels (a fresh adapter: the base model) agrees."""
    messages = looking(png((96, 64)), png((64, 64), (9, 9, 9)))
    turn = screenshot_turn(engine, messages)
    hint = "Click the button at the top."
    hinted = with_hint(messages, hint)
    assert images_of(hinted) == images_of(messages)
    teacher = teacher_logprobs(engine, turn, hint)
    learner = Learner("tiny-vl", TrainerConfig(lora_rank=4, lora_alpha=8), tmp_path)
    recomputed = TrainSample(
        seq=0,
        prompt_ids=tuple(engine.encode(hinted)),
        completion_ids=turn.completion_token_ids,
        rollout_logprobs=teacher,
        advantages=(0.0,) * len(teacher),
        policy_version=learner.version,
        images=tuple(images_of(hinted)),
    )
    gap = gaps(learner, [recomputed])
    assert gap.max() < GAP, f"mean {gap.mean():.2e} max {gap.max():.2e}"
    # unhinted, the base model's score is what it sampled
    rescored = engine.score(
        turn.prompt_token_ids, turn.completion_token_ids, BASE, images_of(messages)
    )
    assert max(abs(a - b) for a, b in zip(rescored, turn.completion_logprobs, strict=True)) < GAP
    with pytest.raises(ValueError, match="placeholders"):  # its ids without its images
        engine.score(turn.prompt_token_ids, turn.completion_token_ids, BASE)


def test_hint_choice_on_a_screenshot_turn_scores_each_candidate_with_its_pixels(engine, tmp_path):
    messages = looking(png((160, 120), (255, 255, 255)))
    candidates = ("Click the button.", "Look at the whole page first, then click.")
    turn = screenshot_turn(engine, messages, Judgement(score=-1, hint_candidates=candidates))
    learner = Learner("tiny-vl", TrainerConfig(lora_rank=4, lora_alpha=8), tmp_path)
    chooser = HintChooser(learner.model, engine.encode, 4, 128, learner.pixels)
    chosen = chooser.choose(turn)
    assert chosen.hint in candidates and len(chosen.hint_overlaps) == 2
    expected = teacher_logprobs(engine, turn, chosen.hint)
    assert max(abs(a - b) for a, b in zip(chosen.teacher_logprobs, expected, strict=True)) < GAP


@pytest.mark.browser
def test_screenshot_demonstrations_are_stored_as_the_policy_would_have_sampled_them(
    engine, tmp_path
):
    """GUI-v0 on screenshots, demonstrated by the solver acting on pixels for `tiny-vl`:
    each turn's prompt ids hold its screenshots' tokens as the engine expands them, and its
    stored log-probs (the learner's, with the pixels) are the base model's on the engine."""
    from agents.demonstrations import record_demonstrations
    from envs.gui.env import GUIEnv
    from trainers.sft import image_expansion

    learner = Learner("tiny-vl", TrainerConfig(lora_rank=4, lora_alpha=8), tmp_path / "learner")
    with Store(tmp_path / "store.sqlite") as store:
        summaries = record_demonstrations(
            lambda: GUIEnv(tasks=["click-test", "enter-text"], observation="screenshot"),
            "gui",
            store,
            engine.tokenizer,
            2,
            learner.logprobs,
            expand=image_expansion(learner),
        )
        turns = [t for s in summaries for t in store.session(s.session_id).turns]
    assert [s.total_reward for s in summaries] == [1.0, 1.0]
    for turn in turns:
        images = images_of(turn.prompt_messages)
        assert list(turn.prompt_token_ids) == engine.encode(turn.prompt_messages, turn.tools)
        rescored = engine.score(turn.prompt_token_ids, turn.completion_token_ids, BASE, images)
        gap = max(abs(a - b) for a, b in zip(rescored, turn.completion_logprobs, strict=True))
        assert gap < GAP
        assert "click_at" in str(turn.completion.get("tool_calls"))
