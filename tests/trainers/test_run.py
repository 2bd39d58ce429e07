import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from agents.config import EnvConfig
from agents.demonstrations import DEMONSTRATION
from agents.rollout import ELIDED
from agents.store import Store
from agents.trajectory import SessionStatus, TurnStatus, TurnType
from agents.vision import images_of
from trainers.config import RunConfig, validate
from trainers.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# Small enough for a 2-core CPU: one question per conversation, short replies, two turns a step.
TINY = [
    "model=tiny",
    "sampling.max_tokens=8",
    "judge.max_tokens=16",
    "trainer.batch_turns=2",
    "trainer.lora_rank=4",
]
TINY_CHAT = "env.chat.kwargs.questions_per_episode=1"
# Four families in one run, each with short episodes: two turns of two rollouts a task.
MIXTURE = [
    "env=[chat,arith,terminal,toolcall]",
    TINY_CHAT,
    "env.chat.weight=2",
    "env.arith.group_size=2",
    "env.arith.max_tokens=16",
    "env.terminal.group_size=2",
    "env.terminal.max_tokens=16",
    "env.terminal.kwargs.max_turns=2",
    "env.terminal.kwargs.sandbox=bwrap",
    "env.toolcall.group_size=2",
    "env.toolcall.max_tokens=16",
    "env.toolcall.kwargs.max_turns=2",
    "env.toolcall.kwargs.tasks=bfcl_single_turn",
    "trainer.batch_turns=12",
]


# The tests' own defaults: chat with the self-judge, no warm start, no evaluation (the main
# job's defaults, arith with a warm start and evaluation, are too slow to repeat per test).
TEST_DEFAULTS = ["method=combine", "judge=self", "sft.warm_start_steps=0", "eval.episodes=0"]


def train(run_dir, *overrides, wait=True):
    chat = [] if any(o.startswith("env=") for o in overrides) else ["env=chat", TINY_CHAT]
    command = [
        sys.executable,
        "-m",
        "trainers.run",
        *TINY,
        *TEST_DEFAULTS,
        *chat,
        f"run_dir={run_dir}",
        *overrides,
    ]
    if not wait:
        return subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("method", ["binary", "opd", "combine"])
def test_each_method_trains_two_steps_on_chat_and_leaves_two_adapters(tmp_path, method):
    run_dir = tmp_path / method
    summary = train(run_dir, f"method={method}", "trainer.max_steps=2")
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == (method, 2, 2)
    assert (run_dir / "adapters" / "v1" / "adapter_model.safetensors").exists()
    assert (run_dir / "adapters" / "v2" / "adapter_model.safetensors").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    env_rows = [r for r in rows if "env" in r]
    rows = [r for r in rows if "env" not in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["turns"] >= 2 for r in rows)
    assert [(r["step"], r["env"]) for r in env_rows] == [(1, "chat"), (2, "chat")]
    assert list((run_dir / "tensorboard").iterdir())
    assert "name: " + method in (run_dir / "config.yaml").read_text()
    with Store(run_dir / "store.sqlite") as store:
        assert (
            store.count_turns(TurnStatus.TRAINED)
            == summary["turns_trained"]
            == sum(r["turns"] for r in rows)
        )
        if method == "opd":  # OPD trains only turns the judge wrote a hint for
            assert all(
                t.judgement.teacher_logprobs for _, t in store.turns(status=TurnStatus.TRAINED)
            )


@pytest.mark.parametrize(
    "method", ["topk_opd", pytest.param("topk_combine", marks=pytest.mark.slow)]
)
def test_a_top_k_method_trains_two_steps_on_chat_from_each_turns_stored_top_k(tmp_path, method):
    run_dir = tmp_path / method
    summary = train(run_dir, f"method={method}", "judge=feedback", "trainer.max_steps=2")
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == (method, 2, 2)
    assert summary["first_loss"] != 0.0  # the top-k term, not a zero policy loss
    with Store(run_dir / "store.sqlite") as store:
        turns = [t for _, t in store.turns(turn_type=TurnType.MAIN)]
        # the proxy kept method.k = 4 top log-probs of every sampled position
        assert all({len(top) for top in t.completion_top_ids} == {4} for t in turns)
        trained = [t for _, t in store.turns(status=TurnStatus.TRAINED)]
        assert len(trained) == summary["turns_trained"] >= 4
        if method == "topk_opd":  # no reward term: only hinted turns train
            assert all(t.judgement.hint for t in trained)
            steps = [r for r in read_metrics(run_dir) if "env" not in r]
            assert [r["distill_tokens"] for r in steps] == [r["tokens"] for r in steps]


def test_a_mixture_of_four_families_trains_each_and_resumes_after_sigkill(tmp_path):
    """`env=[chat,arith,terminal,toolcall]`: one policy, judge and learner; every env's turns
    are judged and trained, each env has its metrics rows, and a run killed mid-way resumes
    with no turn trained twice or lost."""
    run_dir = tmp_path / "mixture"
    # groups whose rewards are all equal train too (with no advantage): whether tiny's
    # replies earn one env a group with a signal within 4 steps is chance (in CI toolcall's
    # did not: every one of its groups was dropped and none of its turns trained)
    binary = ["method=binary", "method.filter_groups=false", "trainer.max_steps=4"]
    victim = train(run_dir, *MIXTURE, *binary, wait=False)
    kill_after_first_checkpoint(victim, run_dir)
    with Store(run_dir / "store.sqlite") as store:
        before = {seq for seq, _ in store.turns()}

    summary = train(run_dir, *MIXTURE, *binary)
    state = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    ledger = [seq for step in state["ledger"] for seq in step]
    assert state["step"] == summary["adapter_version"] == 4 and len(state["ledger"]) == 4
    assert len(ledger) == len(set(ledger)), "a turn was trained twice"
    envs = {"chat", "arith", "terminal", "toolcall"}
    with Store(run_dir / "store.sqlite") as store:
        statuses = {seq: turn.status for seq, turn in store.turns()}
        env_of = {s.session_id: s.env_id for s in store.sessions()}
        judged, trained = set(), set()
        for _, turn in store.turns(turn_type=TurnType.MAIN):
            if turn.judgement is not None:
                judged.add(env_of[turn.session_id])
            if turn.status == TurnStatus.TRAINED:
                trained.add(env_of[turn.session_id])
    assert before <= set(statuses), "a turn stored before the kill is gone"
    assert {s for s, status in statuses.items() if status == TurnStatus.TRAINED} == set(ledger)
    assert judged == trained == envs, (judged, trained)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every step, the killed run's and the resumed one's, has a row for the run and each env
    for step in (1, 2, 3, 4):
        assert Counter(r.get("env") for r in rows if r["step"] == step) == Counter(envs | {None})
    assert set(summary["envs"]) <= envs and summary["envs"]


def kill_after_first_checkpoint(victim: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILLs the run `victim` as soon as its first checkpoint is on disk (looking every
    10 ms), so that the kill lands in the few ms between the checkpoint and what follows."""
    state = run_dir / "checkpoints" / "latest" / "state.json"
    deadline = time.monotonic() + 600
    while not state.exists():
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.01)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)


def test_a_run_killed_right_after_a_checkpoint_keeps_every_steps_metrics(tmp_path):
    """Killed with SIGKILL right after its first checkpoint, then resumed to the end by the
    same command: metrics.jsonl holds each step's rows exactly once, and summary.json
    counts the whole run (its steps, losses and episodes), not the resumed process's part."""
    run_dir = tmp_path / "killed"
    args = ("method=binary", "trainer.max_steps=3")
    kill_after_first_checkpoint(train(run_dir, *args, wait=False), run_dir)
    killed_at = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    assert killed_at["step"] == 1, "the kill came after a later checkpoint"
    # The kill may land after step 1's rows reached the file (the window is a publish, a
    # few ms); one before it leaves them only in the checkpoint, the case this is about:
    # taking them off the file makes it certain.
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_text().splitlines()
        metrics.write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] < 1))

    summary = train(run_dir, *args)
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "env" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3], "a step's row is missing or doubled"
    assert [(r["step"], r["env"]) for r in rows if "env" in r] == [(s, "chat") for s in (1, 2, 3)]
    assert (summary["steps"], summary["adapter_version"]) == (3, 3)
    assert (summary["first_loss"], summary["last_loss"]) == (steps[0]["loss"], steps[-1]["loss"])
    with Store(run_dir / "store.sqlite") as store:
        trained = store.count_turns(TurnStatus.TRAINED)
        episodes = [s for s in store.sessions() if s.env_id == "chat" and s.status != "open"]
    assert trained == summary["turns_trained"] == sum(r["turns"] for r in steps)
    assert summary["episodes"] == len(episodes) > 0


FAULTY = "tests.trainers.faulty_envs:clawgym-test/Faulty-v0"


def test_bad_episodes_are_recorded_with_their_reasons_and_the_run_goes_on(tmp_path):
    """An episode whose history outgrows the context is elided, then truncated; one whose
    sandbox dies mid-episode fails; each with its reason in the store, and the run still
    reaches max_steps."""
    from trainers.run import train as train_in_process

    config = RunConfig(
        env={
            "dies": EnvConfig(id=FAULTY, kwargs={"fault": "die", "max_turns": 3}, group_size=2),
            "floods": EnvConfig(id=FAULTY, kwargs={"fault": "flood", "max_turns": 6}, group_size=2),
        }
    )
    config.model.name = "tiny"
    # tiny: ~540 tokens of prompt and tools, then 2 tokens a flooding word (100, 200, 300...):
    # turn 3 fits once turn 1's output is elided; turn 4 cannot fit at all
    config.engine.context_length = 1100
    config.sampling.max_tokens = 8
    config.judge.max_tokens = 16
    config.method.name = "binary"
    config.trainer.batch_turns = 4
    config.trainer.max_steps = 2
    config.trainer.lora_rank = 4
    summary = train_in_process(config, tmp_path)
    assert summary.steps == 2
    with Store(tmp_path / "store.sqlite") as store:
        sessions = store.sessions()
        ends = {(s.env_id, str(s.status), s.metadata.get("end_reason")) for s in sessions}
        flooded = [
            t for s in sessions if s.env_id == "floods" for t in store.session(s.session_id).turns
        ]
    assert ("dies", "failed") in {(e, s) for e, s, _ in ends}
    died = [r for e, s, r in ends if e == "dies" and s == "failed"]
    assert all("sandbox" in (r or "") for r in died), died
    assert ("floods", "truncated", "context") in ends, ends
    assert any(ELIDED in str(t.prompt_messages) for t in flooded), "no history was elided"
    assert summary.envs["dies"]["failed"] >= 1 and summary.envs["floods"]["truncated"] >= 1


def composed(*overrides: str) -> RunConfig:
    """The run config `python -m trainers.run` composes from these overrides (the model's
    own run defaults included), for a run in this process: no interpreter to start."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainers.config import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "trainers" / "conf"), version_base=None):
        cfg = compose("config", overrides=[*TINY, *TEST_DEFAULTS, *overrides, "run_dir=."])
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


# `env=gui env.gui.kwargs.observation=screenshot model=tiny-vl`, small: one task, two
# rollouts of two turns a group, the outcome as the judge
VL_GUI = [
    "env.gui.kwargs.observation=screenshot",
    "model=tiny-vl",
    "method=binary",
    "judge=env",
    "+env.gui.kwargs.tasks=[click-test]",
    "env.gui.kwargs.max_turns=2",
    "env.gui.group_size=2",
    "env.gui.max_tokens=8",
    "trainer.max_steps=2",
]


@pytest.mark.browser
def test_a_vl_policy_trains_on_gui_screenshots_from_the_plain_command(tmp_path):
    """The plain command's config, made small: the warm start imitates the solver acting on
    pixels (one supervised step on two demonstrations), tiny-vl's own run defaults
    (trainers/conf/model_run/tiny-vl.yaml) play on though no group of the random model has
    a signal, and the learner trains on turns with their screenshots."""
    from trainers.run import train as train_in_process

    config = composed("env=gui", *VL_GUI, "sft.warm_start_steps=1", "sft.episodes=2")
    assert not config.method.filter_groups and config.rollout.max_signalless_groups == 0
    summary = train_in_process(config, tmp_path)
    assert (summary.steps, summary.adapter_version) == (3, 3)  # one supervised, two RL
    with Store(tmp_path / "store.sqlite") as store:
        demonstrated = [s for s in store.sessions() if DEMONSTRATION in s.metadata]
        trained = [t for _, t in store.turns(status=TurnStatus.TRAINED)]
    assert len(demonstrated) == 2 and all(s.outcome_reward == 1.0 for s in demonstrated)
    imitated = {s.session_id for s in demonstrated}
    rl = [t for t in trained if t.session_id not in imitated]
    assert len(trained) == summary.turns_trained and len(rl) >= 4  # the demos, then RL
    assert all(images_of(t.prompt_messages) for t in trained)
    assert summary.logprob_gap_max < 1e-3


@pytest.mark.browser
def test_a_mixture_of_screenshots_and_text_trains_and_a_bad_image_fails_only_its_episode(
    tmp_path,
):
    """`env=[gui,arith]`: GUI screenshots and arith's text played by one tiny-vl policy,
    which trains on them; a third env shows an image over `model.max_image_bytes` (the one
    setting the proxy and the engine read): the proxy refuses that request, the episode ends
    failed saying why, its first turn is kept with the image as its next state, and the run
    goes to its end."""
    from trainers.run import train as train_in_process

    config = composed(
        "env=[gui,arith]",
        *VL_GUI,
        "env.arith.group_size=2",
        "env.arith.max_tokens=8",
        "env.arith.kwargs.max_turns=2",
        "model.max_image_bytes=65536",
        "rollout.groups_in_flight=3",
        "trainer.batch_turns=4",
    )
    bad = {"fault": "image", "image": "large", "max_turns": 3}
    config.env["bad"] = EnvConfig(id=FAULTY, kwargs=bad, group_size=2, max_tokens=8)
    summary = train_in_process(config, tmp_path)
    assert summary.steps == 2 and summary.envs["bad"]["failed"] >= 1
    with Store(tmp_path / "store.sqlite") as store:
        sessions = {s.session_id: s for s in store.sessions()}
        refused = [store.session(i) for i, s in sessions.items() if s.env_id == "bad"]
        turns = [t for _, t in store.turns(turn_type=TurnType.MAIN)]
        trained = [t for t in turns if t.status == TurnStatus.TRAINED]
    played = {sessions[t.session_id].env_id for t in turns}
    assert played == {"gui", "arith", "bad"} and len(trained) == summary.turns_trained >= 8
    # which env's groups the two steps took depends on which finished first
    assert all(
        bool(images_of(t.prompt_messages)) == (sessions[t.session_id].env_id == "gui")
        for t in turns
    )
    for session in refused:
        assert session.status == SessionStatus.FAILED
        assert "over 65536 bytes" in session.metadata["end_reason"]
        (turn,) = session.turns
        assert len(images_of(turn.next_state, None)[0]) > 64 << 10  # kept, byte for byte


def test_a_run_whose_groups_all_score_the_same_stops_saying_so(tmp_path):
    """An env no answer solves gives every rollout of a group the outcome 0: nothing to learn
    from, so the run stops after `rollout.max_signalless_groups` groups, naming the env."""
    from trainers.run import train as train_in_process

    never = EnvConfig(id=FAULTY, kwargs={"fault": "never", "max_turns": 2}, group_size=2)
    config = RunConfig(env={"never": never})
    config.model.name = "tiny"
    config.sampling.max_tokens = 8
    config.judge.kind = "env"
    config.method.name = "binary"
    config.trainer.batch_turns = 2
    config.trainer.lora_rank = 4
    config.rollout.max_signalless_groups = 3
    with pytest.raises(RuntimeError) as stopped:
        train_in_process(config, tmp_path)
    message = str(stopped.value)
    assert "env 'never': 3 groups in a row scored the same (every reward 0.0)" in message
    assert "first episode ended done (max_turns)" in message
    with Store(tmp_path / "store.sqlite") as store:
        assert store.count_turns(TurnStatus.TRAINED) == 0
        assert store.count_turns(TurnStatus.DROPPED, TurnType.MAIN) >= 6  # filtered, marked


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: setattr(c.env["chat"], "group_size", 0), "env.chat.group_size"),
        (lambda c: c.env.clear(), "no environment"),
        (lambda c: setattr(c.env["chat"], "weight", 0.0), "env.chat.weight"),
        (lambda c: setattr(c.rollout, "groups_in_flight", 0), "groups_in_flight"),
        (lambda c: setattr(c.method, "baseline", "task"), "method.baseline"),
        (lambda c: setattr(c.rollout, "max_signalless_groups", -1), "max_signalless_groups"),
        (lambda c: setattr(c.engine, "backend", "tgi"), "engine=embedded"),
        (lambda c: setattr(c.env["chat"], "id", "CartPole-v1"), "clawgym/"),
        (lambda c: setattr(c.method, "name", "ppo"), "method=binary"),
        (lambda c: setattr(c.judge, "kind", "remote"), "judge.base_url"),
        (
            lambda c: (setattr(c.method, "name", "opd"), setattr(c.judge, "kind", "env")),
            "LLM judge",
        ),
        (
            lambda c: (
                setattr(c.env["chat"], "outcome_weight", 0.0),
                setattr(c.judge, "kind", "env"),
            ),
            "no outcome to learn from",
        ),
        (lambda c: setattr(c.sft, "warm_start_steps", -1), "warm_start_steps"),
        (lambda c: setattr(c.trainer, "clip_low", 1.5), "clip_low"),
        (lambda c: setattr(c.trainer, "max_backlog", 4), "max_backlog"),
        (lambda c: setattr(c.env["chat"], "users", "robots"), "env.chat.users"),
        (lambda c: setattr(c.serve, "host", "0.0.0.0"), "serve.api_key"),
        (lambda c: setattr(c.serve, "api_keys", ["alice k1"]), "rollouts reach the proxy"),
        (lambda c: setattr(c.serve, "api_keys", ["local k1"]), "serve.api_keys: a user"),
        (lambda c: setattr(c.engine, "backend", "remote"), "engine.base_url"),
        (
            lambda c: (
                setattr(c.engine, "backend", "remote"),
                setattr(c.engine, "base_url", "http://127.0.0.1:1/v1"),
            ),
            "cannot train",
        ),
        (
            lambda c: (setattr(c.engine, "backend", "vllm"), setattr(c.trainer, "lora_rank", 32)),
            "engine.max_lora_rank",
        ),
        (lambda c: setattr(c.trainer, "device", "tpu"), "trainer.device"),
        (lambda c: setattr(c.trainer, "dtype", "fp8"), "trainer.dtype"),
        (lambda c: setattr(c.trainer, "threads", 0), "trainer.threads"),
        (lambda c: setattr(c.trainer, "gradient_checkpointing", "maybe"), "auto, true or false"),
        (lambda c: setattr(c.eval, "pass_k_at", ["switch", "end"]), "unknown \\['end'\\]"),
        (lambda c: setattr(c.method, "k", 0), "method.k must be in 1..20"),
        (lambda c: setattr(c.method, "subset", "both"), "method.subset must be one of"),
        (lambda c: setattr(c.method, "diff_clip", 0.0), "method.diff_clip must be > 0"),
        (lambda c: setattr(c.method, "topk_clip", -1.0), "method.topk_clip must be > 0"),
        (
            lambda c: (setattr(c.method, "name", "topk_opd"), setattr(c.judge, "kind", "env")),
            "LLM judge",
        ),
        (
            lambda c: (
                setattr(c.method, "name", "topk_combine"),
                setattr(c.backend, "kind", "tinker"),
                setattr(c.backend, "api_key", "tml-x"),
            ),
            "use backend=local",
        ),
    ],
)
def test_bad_config_values_say_the_fix(change, fragment):
    config = RunConfig(env={"chat": EnvConfig(id="clawgym/Chat-v0")})
    validate(config)  # valid before the change
    change(config)
    with pytest.raises(ValueError, match=fragment):
        validate(config)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _client_of(trainer, port):
    """An openai client of the trainer's proxy on `port`, once it answers."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 300
    while True:
        assert trainer.poll() is None, trainer.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the trainer's proxy never answered"
        try:
            client.models.list()
            return client
        except Exception:
            time.sleep(0.5)


def test_live_users_train_the_policy_they_talk_to(tmp_path):
    """`env.users=live`: the trainer serves the proxy; two people chat through the openai
    client; their feedback is judged and trained on, and the new adapter is what serves."""

    run_dir, port = tmp_path / "live", _free_port()
    trainer = train(
        run_dir,
        "env.chat.users=live",
        "judge=feedback",
        "method=binary",
        "trainer.max_steps=2",
        f"serve.port={port}",
        wait=False,
    )
    client = _client_of(trainer, port)
    deadline = time.monotonic() + 300

    def say(session, history, text, done=False):
        history.append({"role": "user", "content": text})
        headers = {"X-Session-Id": session} | ({"X-Session-Done": "1"} if done else {})
        reply = client.chat.completions.create(
            model="policy", messages=history, max_tokens=8, extra_headers=headers
        )
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        return reply

    def chat(round_):
        for person, feedback in (("ana", "Too long. Keep it under five words."), ("bo", "Thanks!")):
            history: list[dict] = []
            say(f"{person}{round_}", history, "What is the capital of France?")
            say(f"{person}{round_}", history, feedback, done=True)

    def served_version():
        return httpx.get(f"http://127.0.0.1:{port}/healthz").json()["policy_version"]

    chat(1)
    while served_version() < 1:  # the first step trains on round 1 and publishes v1
        assert trainer.poll() is None, trainer.stderr.read()[-3000:]
        assert time.monotonic() < deadline + 300, "no adapter was published"
        time.sleep(0.2)
    chat(2)
    assert trainer.wait(timeout=600) == 0, trainer.stderr.read()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["adapter_version"]) == (2, 2)
    with Store(run_dir / "store.sqlite") as store:
        turns = [t for _, t in store.turns()]
    scores = {t.session_id: t.judgement.score for t in turns if t.status == TurnStatus.TRAINED}
    assert scores == {"ana1": -1.0, "bo1": 1.0, "ana2": -1.0, "bo2": 1.0}
    assert {t.policy_version for t in turns if t.session_id.endswith("1")} == {0}
    assert {t.policy_version for t in turns if t.session_id.endswith("2")} == {1}


def test_live_users_beside_simulated_envs_in_one_run(tmp_path):
    """`serve.enabled=true` with simulated envs: a person's conversation and the arith
    episodes reach the same policy, judge and learner; both are trained in one run."""

    run_dir, port = tmp_path / "beside", _free_port()
    trainer = train(
        run_dir,
        "env=[arith]",
        "env.arith.group_size=2",
        "env.arith.max_tokens=16",
        "env.arith.weight=1",
        "judge=feedback",  # the run's judge reads the person's words...
        "env.arith.judge=self",  # ...and the base model judges the arith turns
        "method=binary",
        "trainer.batch_turns=4",
        "trainer.max_steps=3",
        "serve.enabled=true",
        f"serve.port={port}",
        wait=False,
    )
    client = _client_of(trainer, port)
    history = [{"role": "user", "content": "What is the capital of France?"}]
    for text, done in ((None, False), ("Too long. Keep it under five words.", True)):
        if text is not None:
            history.append({"role": "user", "content": text})
        headers = {"X-Session-Id": "ana"} | ({"X-Session-Done": "1"} if done else {})
        reply = client.chat.completions.create(
            model="policy", messages=history, max_tokens=8, extra_headers=headers
        )
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert trainer.wait(timeout=900) == 0, trainer.stderr.read()[-3000:]
    with Store(run_dir / "store.sqlite") as store:
        env_of = {s.session_id: s.env_id for s in store.sessions()}
        trained = {env_of[t.session_id] for _, t in store.turns(status=TurnStatus.TRAINED)}
        ana = [t for t in store.session("ana").turns if t.turn_type == TurnType.MAIN]
    assert env_of["ana"] == "live" and "arith" in set(env_of.values())
    assert ana[0].judgement is not None and ana[0].judgement.score == -1.0
    assert trained == {"live", "arith"}, trained


@pytest.mark.slow
def test_a_mixture_with_the_browser_and_swe_families_trains(tmp_path):
    """Under `slow`: GUI (Chromium) and SWE (sandboxed repositories) beside arith in one run."""
    run_dir = tmp_path / "wide"
    summary = train(
        run_dir,
        "env=[arith,gui,swe]",
        "env.arith.group_size=2",
        "env.arith.max_tokens=16",
        "env.gui.group_size=2",
        "env.gui.max_tokens=16",
        "env.gui.kwargs.max_turns=2",
        "env.swe.group_size=2",
        "env.swe.max_tokens=16",
        "env.swe.kwargs.max_turns=2",
        "env.swe.kwargs.sandbox=bwrap",
        "rollout.groups_in_flight=3",
        "trainer.batch_turns=8",
        "trainer.max_steps=2",
        "method=binary",
    )
    assert summary["steps"] == 2
    assert set(summary["envs"]) == {"arith", "gui", "swe"}
    for name, figures in summary["envs"].items():
        assert figures["episodes"] >= 2, (name, figures)
    with Store(run_dir / "store.sqlite") as store:
        env_of = {s.session_id: s.env_id for s in store.sessions()}
        judged = {env_of[t.session_id] for _, t in store.turns() if t.judgement is not None}
    assert judged == {"arith", "gui", "swe"}, judged


@pytest.mark.slow
def test_tau2_trains_with_its_model_driven_user_played_by_the_runs_own_server(tmp_path):
    """`env=tau2`: tau2's user is a model, here the run's own server with the adapter off;
    its requests are side turns (stored, never trained), the agent's turns train."""
    run_dir = tmp_path / "tau2"
    summary = train(
        run_dir,
        "env=[tau2]",
        "engine.context_length=16384",
        "env.tau2.group_size=2",
        "env.tau2.max_tokens=16",
        "env.tau2.kwargs.max_turns=2",
        "env.tau2.kwargs.user_max_turns=2",
        "serve.max_tokens=32",
        "method=binary",
        "trainer.max_steps=1",
    )
    assert summary["steps"] == 1 and summary["envs"]["tau2"]["episodes"] >= 2
    with Store(run_dir / "store.sqlite") as store:
        env_of = {s.session_id: s.env_id for s in store.sessions()}
        kinds = {(env_of[t.session_id], t.turn_type) for _, t in store.turns()}
        trained = {env_of[t.session_id] for _, t in store.turns(status=TurnStatus.TRAINED)}
    assert ("live", TurnType.SIDE) in kinds  # the user model's requests
    assert trained == {"tau2"}
