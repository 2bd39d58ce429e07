"""`trainers.run` with hint candidates chosen by the learner and with experience
distillation (`method=oel`), on chat with the tiny model (engine=embedded)."""

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from hydra import compose as compose_config
from hydra import initialize_config_dir
from omegaconf import OmegaConf
from openai import OpenAI

from agents.config import EnvConfig
from agents.serving.identity import bearer, client_id, home_credentials, scope_of, stored_id
from agents.store import Store
from agents.trajectory import TurnStatus, TurnType
from tests.trainers.test_run import MIXTURE, ROOT, TEST_DEFAULTS, TINY, TINY_CHAT, _free_port, train
from trainers.config import RunConfig, validate
from trainers.metrics import read_metrics
from trainers.run import train as train_in_process

CLAW_KEY = "claw-key"
"""OpenClaw's bearer token: on a proxy without a key any credential is let in, and its
sessions are stored under the credential's scope."""

SEVERAL_HINTS = "judge.kind=tests.trainers.several_hints:SeveralHints"


@pytest.mark.parametrize("selection", ["overlap", pytest.param("longest", marks=pytest.mark.slow)])
def test_a_run_chooses_among_hint_candidates_by_its_selection_and_stores_them(tmp_path, selection):
    run_dir = tmp_path / selection
    summary = train(
        run_dir,
        "method=opd",
        SEVERAL_HINTS,
        "judge.votes=1",
        f"judge.hint_selection={selection}",
        "trainer.max_steps=2",
    )
    assert (summary["steps"], summary["adapter_version"]) == (2, 2)
    with Store(run_dir / "store.sqlite") as store:
        trained = [t.judgement for _, t in store.turns(status=TurnStatus.TRAINED)]
        judged = [t.judgement for _, t in store.turns(turn_type=TurnType.MAIN) if t.judgement]
    several = [j for j in trained if len(j.hint_candidates) > 1]
    assert several and all(j.teacher_logprobs for j in trained)
    for judgement in several:
        candidates = judgement.hint_candidates
        if selection == "overlap":
            scores = judgement.hint_overlaps
            assert len(scores) == len(candidates)
            assert judgement.hint == candidates[scores.index(max(scores))]
        else:
            assert judgement.hint == max(candidates, key=len) and not judgement.hint_overlaps
    # no judged turn is left waiting for a choice once the learner has seen it
    assert not any(j.awaits_hint_choice for j in trained)
    assert len(judged) >= len(trained)


def oel_run(run_dir, *overrides):
    summary = train(
        run_dir,
        "method=oel",
        "judge=feedback",
        "trainer.max_steps=2",
        "method.experience_max_tokens=16",
        *overrides,
    )
    assert (summary["method"], summary["steps"], summary["adapter_version"]) == ("oel", 2, 2)
    assert summary["first_loss"] > 0  # the reverse KL: no advantage, no policy loss
    steps = [r for r in read_metrics(run_dir) if "env" not in r]
    assert [r["distill_tokens"] for r in steps] == [r["tokens"] for r in steps]  # every turn
    with Store(run_dir / "store.sqlite") as store:
        trained = [t for _, t in store.turns(status=TurnStatus.TRAINED)]
        sessions = store.sessions(session_ids={t.session_id for t in trained})
        assert len(trained) == summary["turns_trained"] >= 4
        for session in sessions:  # each written once its episode ended, over all its turns
            mains = [t for t in store.session(session.session_id).turns if t.turn_type == "main"]
            assert session.status != "open" and session.metadata["experience"]
            assert session.metadata["experience_turns"] == len(mains)
    return summary


def test_oel_trains_two_steps_on_chat_from_each_sessions_notes(tmp_path):
    oel_run(tmp_path / "oel")


@pytest.mark.vllm  # in the default run, as the embedded one: 54 s here with vLLM's start
def test_oel_trains_two_steps_on_chat_with_vllm_serving(tmp_path):
    summary = oel_run(tmp_path / "oel", "engine=vllm", "engine.max_lora_rank=8")
    assert summary["engine"] == "vllm"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: setattr(c.judge, "hint_selection", "random"), "judge.hint_selection='random'"),
        (lambda c: setattr(c.judge, "overlap_k", 0), "judge.overlap_k must be >= 1"),
        (lambda c: setattr(c.method, "teacher_k", 0), "method.teacher_k"),
        (
            lambda c: (
                setattr(c.method, "name", "oel"),
                setattr(c.backend, "kind", "tinker"),
                setattr(c.backend, "api_key", "tml-x"),
            ),
            "method=oel takes the teacher's log-probs from the local learner",
        ),
    ],
)
def test_bad_distillation_values_say_the_fix(change, fragment):
    config = RunConfig(env={"chat": EnvConfig(id="clawgym/Chat-v0")})
    validate(config)
    change(config)
    with pytest.raises(ValueError, match=fragment):
        validate(config)


@pytest.mark.parametrize("method", ["topk_opd", "topk_combine", "oel"])
def test_a_mixture_composes_and_validates_with_each_distillation_method(method):
    """`env=[chat,arith,terminal,toolcall] method=...`: the method's group settings and every
    env's own reach one valid config (the mixture's run itself is binary's test, test_run)."""
    config = composed(*MIXTURE, f"method={method}", "judge=self")
    validate(config)
    assert set(config.env) == {"chat", "arith", "terminal", "toolcall"}
    assert (config.method.name, config.env["arith"].group_size) == (method, 2)
    assert config.method.w_rl == (0.0 if method == "topk_opd" else 1.0)


@pytest.mark.slow  # 40-50 s on 2 shared cores
def test_top_k_combine_runs_a_mixture_of_chat_and_arith_with_a_judge_each(tmp_path):
    """One policy and learner on chat (the run's feedback judge: hints, the top-k term) and
    arith (`env.arith.judge=env`: its outcome, the reward term alone). tiny solves no arith
    task, so every arith group scores 0 and, with no hint either, is dropped; the chat turns
    train on their top-k."""
    run_dir = tmp_path / "mixture"
    summary = train(
        run_dir,
        "env=[chat,arith]",
        TINY_CHAT,
        "env.arith.group_size=2",
        "env.arith.max_tokens=16",
        "env.arith.judge=env",
        "judge=feedback",
        "method=topk_combine",
        "rollout.max_signalless_groups=0",
        "trainer.batch_turns=8",
        "trainer.max_steps=2",
    )
    assert (summary["method"], summary["steps"]) == ("topk_combine", 2)
    with Store(run_dir / "store.sqlite") as store:
        env_of = {s.session_id: s.env_id for s in store.sessions()}
        mains = [t for _, t in store.turns(turn_type=TurnType.MAIN)]
    judged = [t for t in mains if t.judgement is not None]
    assert {env_of[t.session_id] for t in judged} == {"chat", "arith"}
    arith = [t for t in judged if env_of[t.session_id] == "arith"]
    assert all(t.judgement.votes == () and t.judgement.hint is None for t in arith)
    assert all(t.status != TurnStatus.TRAINED for t in arith)
    trained = [t for t in mains if t.status == TurnStatus.TRAINED]
    assert trained and {env_of[t.session_id] for t in trained} == {"chat"}
    steps = [r for r in read_metrics(run_dir) if "env" not in r]
    hinted = [t for t in trained if t.judgement.hint]
    assert (
        sum(r["distill_tokens"] for r in steps)
        == sum(len(t.completion_token_ids) for t in hinted)
        > 0
    )


@pytest.mark.parametrize("method", ["opd", "topk_opd"])
def test_a_hint_only_method_refuses_an_env_judged_by_its_outcome_alone(method):
    """opd and topk_opd learn from hints only; an env judged by its outcome gets none, so
    none of its turns would ever train (and the run would stop on its signal-less groups)."""
    config = composed(*MIXTURE, f"method={method}", "judge=self", "env.arith.judge=env")
    with pytest.raises(ValueError, match="env 'arith' is judged by its outcome"):
        validate(config)
    validate(composed(*MIXTURE, "method=topk_combine", "judge=self", "env.arith.judge=env"))


def test_an_openclaw_style_client_drives_a_topk_opd_run_whose_turns_train(tmp_path):
    """OpenClaw-RL's scenario with its 2026 loss: `env.chat.users=live method=topk_opd`.
    The official `openai` client talks to the run's proxy as OpenClaw does (its bearer key,
    its session-affinity headers `session_id` / `x-session-affinity: <id>:0`, never a
    session-done header; a side request beside the main ones) and asks for OpenAI's
    `top_logprobs`. Each person's complaint is judged, its hint becomes the teacher's, and
    the step trains both first turns on their top-k targets: the very top-k the client was
    served, stored with the turn."""
    run_dir, port = tmp_path / "claw", _free_port()
    overrides = ("env.chat.users=live", "judge=feedback", "method=topk_opd")
    config = composed(*overrides, "trainer.max_steps=1", f"serve.port={port}")
    # in this process, not a subprocess: the imports a fresh interpreter pays are half the cost
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(train_in_process, config, run_dir)
        client = openai_client(run, port).with_options(api_key=CLAW_KEY)
        served = talk_as_openclaw(client)
        summary = run.result(timeout=600)
    assert (summary.method, summary.steps) == ("topk_opd", 1)
    (step,) = [r for r in read_metrics(run_dir) if "env" not in r]
    with Store(run_dir / "store.sqlite") as store:
        trained = [t for _, t in store.turns(status=TurnStatus.TRAINED)]
        side = [t for _, t in store.turns(turn_type=TurnType.SIDE)]
    scope = scope_of(bearer(CLAW_KEY), home_credentials(None))
    assert {t.session_id for t in trained} == {stored_id(scope, p) for p in ("ana", "bo")}
    assert step["turns"] == 2 and step["distill_tokens"] == sum(
        len(t.completion_token_ids) for t in trained
    )
    assert step["loss"] != 0.0
    for turn in trained:
        assert turn.index == 0 and turn.judgement.score == -1.0 and turn.judgement.hint
        person = client_id(scope, turn.session_id)
        stored = [lp for top in turn.completion_top_logprobs for lp in top]
        assert stored == pytest.approx([lp for top in served[person] for lp in top], abs=1e-6)
        assert {len(top) for top in turn.completion_top_ids} == {4}
    assert len(side) == 2 and all(t.status != TurnStatus.TRAINED for t in side)


def composed(*overrides: str) -> RunConfig:
    """The config `python -m trainers.run` runs with, given the tests' defaults and these
    (chat unless they name the envs)."""
    chat = () if any(o.startswith("env=") for o in overrides) else ("env=chat", TINY_CHAT)
    with initialize_config_dir(str(ROOT / "trainers" / "conf"), version_base=None):
        cfg = compose_config("config", overrides=[*TINY, *TEST_DEFAULTS, *chat, *overrides])
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def openai_client(run: Future, port: int) -> OpenAI:
    """An openai client of the run's proxy on `port`, once it answers."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 300
    while True:
        if run.done():
            run.result()  # raises the run's error
        assert time.monotonic() < deadline, "the trainer's proxy never answered"
        try:
            client.models.list()
            return client
        except Exception:
            time.sleep(0.2)


def ask(
    client: OpenAI, history: list[dict], headers: dict[str, str], stream: bool
) -> tuple[str, list[list[float]]]:
    """One reply with its top-4 log-probs per position, streamed or whole."""
    asked = dict(model="policy", messages=history, max_tokens=8, logprobs=True, top_logprobs=4)
    if not stream:
        choice = client.chat.completions.create(**asked, extra_headers=headers).choices[0]
        tops = [[t.logprob for t in p.top_logprobs] for p in choice.logprobs.content]
        return choice.message.content or "", tops
    text, tops = "", []
    for chunk in client.chat.completions.create(**asked, stream=True, extra_headers=headers):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            for position in (chunk.choices[0].logprobs and chunk.choices[0].logprobs.content) or ():
                tops.append([t.logprob for t in position.top_logprobs])
    return text, tops


def talk_as_openclaw(client: OpenAI) -> dict[str, list[list[float]]]:
    """Two people's conversations: a question (its top-4 log-probs asked for; one streamed),
    a side request, a complaint. Returns each person's served top-4 log-probs per position."""
    served: dict[str, list[list[float]]] = {}
    for person in ("ana", "bo"):
        claw = {"session_id": f"{person}:0", "x-session-affinity": f"{person}:0"}
        history = [{"role": "user", "content": "What is the capital of France?"}]
        # OpenClaw streams its replies: bo's first is streamed, ana's whole
        text, served[person] = ask(client, history, claw, stream=person == "bo")
        client.chat.completions.create(  # OpenClaw's own request beside the user's: a side turn
            model="policy",
            messages=[{"role": "user", "content": "Name this conversation."}],
            max_tokens=4,
            extra_headers=claw | {"X-Turn-Type": "side"},
        )
        history += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Too long. Keep it under five words."},
        ]
        client.chat.completions.create(
            model="policy", messages=history, max_tokens=8, extra_headers=claw
        )
    return served
