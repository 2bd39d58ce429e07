"""tinker-cookbook's own training loops, unchanged, against clawgym's Tinker server on tiny.

Only `base_url` and a key (TINKER_API_KEY) point the cookbook here. Its `model_name` is the
local model directory the server reports as tokenizer id in get_info: the cookbook loads a
tokenizer from a directory with AutoTokenizer (no hub), and the server accepts that
directory as the name of the base model it serves. `qwen3_instruct` is the cookbook renderer
that writes tiny's ChatML template.
"""

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import chz
import pytest
import tinker
from safetensors.torch import load_file

from agents import models
from trainers.tinker import checkpoints
from trainers.tinker.app import in_thread
from trainers.tinker.errors import UserError
from trainers.tinker.service import TinkerService

rl_train = pytest.importorskip("tinker_cookbook.rl.train")
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl.types import (  # noqa: E402
    Env,
    EnvGroupBuilder,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

RENDERER = "qwen3_instruct"
CONVERSATIONS = [
    [("user", "What is 2 + 3?"), ("assistant", "5")],
    [("user", "Name a colour."), ("assistant", "Blue.")],
    [("system", "You answer briefly."), ("user", "Say hi."), ("assistant", "Hi!")],
    [("user", "Count to three."), ("assistant", "one two three")],
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server as `python -m trainers.tinker model=tiny` runs it: (base_url, run_dir)."""
    run_dir = tmp_path_factory.mktemp("tinker-run")
    with in_thread(TinkerService("tiny", run_dir), api_key="tml-cookbook") as url:
        yield url, run_dir


@pytest.fixture
def cookbook_env(monkeypatch):
    """The only settings the cookbook gets besides base_url: the key, no telemetry."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-cookbook")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tiny_dir() -> str:
    return str(models.resolve("tiny"))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trained_adapter(run_dir: Path, log_path: Path) -> dict:
    """The adapter of the cookbook's final sampler checkpoint, read from the server's disk."""
    final = _rows(log_path / "checkpoints.jsonl")[-1]
    return load_file(
        checkpoints.directory(run_dir, final["sampler_path"]) / "adapter_model.safetensors"
    )


def _assert_lora_b_moved(adapter: dict) -> None:
    """peft starts every lora_B at zero: a non-zero one means optimizer steps changed it."""
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b
    assert any(float(t.abs().max()) > 0 for t in lora_b)


def test_supervised_train_main_runs_two_steps(server, cookbook_env, tmp_path):
    base_url, run_dir = server
    data = tmp_path / "conversations.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": r, "content": c} for r, c in convo]}) + "\n"
            for convo in CONVERSATIONS
        )
    )
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=_tiny_dir(), renderer_name=RENDERER, max_length=64, batch_size=2
    )
    config = sl_train.Config(
        log_path=str(tmp_path / "sl"),
        model_name=_tiny_dir(),
        recipe_name="clawgym_test",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
        learning_rate=1e-2,
        lora_rank=4,
        base_url=base_url,
        eval_every=0,
        infrequent_eval_every=0,
    )
    asyncio.run(sl_train.main(config))

    metrics = _rows(tmp_path / "sl" / "metrics.jsonl")
    steps = [row for row in metrics if "train_mean_nll" in row]
    assert [row["step"] for row in steps] == [0, 1]
    assert all(math.isfinite(row["train_mean_nll"]) and row["train_mean_nll"] > 0 for row in steps)
    assert all(row["num_sequences"] == 2 for row in steps)
    _assert_lora_b_moved(_trained_adapter(run_dir, tmp_path / "sl"))


class TokenIdsEnv(Env):
    """One chat turn, rewarded by the mean of its token ids modulo 1000, scaled to [0, 1]:
    distinct random samples of the untrained tiny model all but never tie, so group
    advantages are non-zero. (A share of even ids, 0 to 8 eighths, once tied in both groups
    of a step, and the step's gradient was 0.)"""

    def __init__(self, renderer: renderers.Renderer):
        self.renderer = renderer

    async def initial_observation(self):
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": "Speak."}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None) -> StepResult:
        return StepResult(
            reward=sum(t % 1000 for t in action) / (999 * max(len(action), 1)),
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
        )


@dataclass(frozen=True)
class TokenIdsGroup(EnvGroupBuilder):
    model_dir: str
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_dir))
        return [TokenIdsEnv(renderer) for _ in range(self.group_size)]


class TokenIdsDataset(RLDataset):
    def __init__(self, model_dir: str, batches: int, groups: int, group_size: int):
        self.model_dir, self.batches = model_dir, batches
        self.groups, self.group_size = groups, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [TokenIdsGroup(self.model_dir, self.group_size) for _ in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class TokenIdsBuilder(RLDatasetBuilder):
    model_dir: str

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return TokenIdsDataset(self.model_dir, batches=2, groups=2, group_size=4), None


def test_rl_train_main_runs_two_iterations(server, cookbook_env, tmp_path):
    base_url, run_dir = server
    config = rl_train.Config(
        learning_rate=1e-2,
        dataset_builder=TokenIdsBuilder(model_dir=_tiny_dir()),
        model_name=_tiny_dir(),
        recipe_name="clawgym_test",
        renderer_name=RENDERER,
        max_tokens=8,
        log_path=str(tmp_path / "rl"),
        eval_every=0,
        save_every=0,
        lora_rank=4,
        base_url=base_url,
    )
    asyncio.run(rl_train.main(config))

    rows = [row for row in _rows(tmp_path / "rl" / "metrics.jsonl") if "grad_norm:mean" in row]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        # 2 groups x 4 samples, each sampled by the server: 1 to max_tokens (8) tokens each,
        # since the random tiny model samples its stop token early now and then (CI: 59)
        assert 8 <= row["env/all/total_ac_tokens"] <= 64
        assert 0 <= row["env/all/reward/total"] <= 1
        # the group's samples differ, so advantages and the gradient are non-zero
        assert math.isfinite(row["grad_norm:mean"]) and row["grad_norm:mean"] > 0
        # the sampler's log-probs are the learner's: no gap between them
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3
    _assert_lora_b_moved(_trained_adapter(run_dir, tmp_path / "rl"))


def test_unseeded_samples_differ_and_seeded_ones_repeat(server, cookbook_env):
    """What a GRPO group needs of the sampler: fresh draws unless a seed is given."""
    base_url, _ = server
    with tinker.ServiceClient(base_url=base_url) as service:
        sampler = service.create_sampling_client(base_model="tiny").result()
        prompt = tinker.ModelInput.from_ints([1, 5, 9, 200])

        def draw(seed: int | None) -> list[int]:
            params = tinker.SamplingParams(max_tokens=8, seed=seed)
            return sampler.sample(prompt, 1, params).result().sequences[0].tokens

        assert draw(None) != draw(None)
        assert draw(11) == draw(11)


def test_the_model_directory_names_the_served_model(tmp_path):
    """The cookbook sends its tokenizer directory as base_model; other names stay refused."""
    engine = TinkerService("tiny", tmp_path)
    engine.check_model("tiny")
    engine.check_model(_tiny_dir())
    with pytest.raises(UserError, match="unknown base model"):
        engine.check_model(str(tmp_path))
