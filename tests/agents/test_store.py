import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import datasets
import pytest

from agents.demonstrations import import_parquet
from agents.store import Store
from agents.trajectory import Judgement, Session, SessionStatus, TurnStatus, TurnType
from tests.agents.test_trajectory import make_turn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "store.sqlite") as opened:
        yield opened


def test_store_is_in_wal_mode(store):
    assert store._db().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_turn_round_trips_exactly(store):
    store.add_session(Session("s", "clawgym/Arith-v0", task_id="t", group_id="g"))
    turn = make_turn(
        completion_logprobs=(-0.123456789012345, -3.0),
        prompt_token_ids=(0, 49151, 2**31 - 1),
        tools=({"type": "function", "function": {"name": "f", "parameters": {}}},),
    )
    store.add_turn(turn)
    assert store.session("s").turns == (turn,)


def test_next_state_judgement_and_statuses_move_a_turn_along(store):
    store.add_session(Session("s", "clawgym/Arith-v0"))
    seq = store.add_turn(make_turn())
    store.set_next_state("s", 0, [{"role": "user", "content": "thanks"}], env_reward=1.0)
    assert store.count_turns(TurnStatus.COLLECTED) == 1
    store.set_judgement(
        "s",
        0,
        Judgement(votes=(1, 1, -1), score=1.0, hint="be brief", teacher_logprobs=(-0.4, -0.9)),
    )
    ((_, judged),) = store.turns(status=TurnStatus.JUDGED)
    assert judged.next_state == ({"role": "user", "content": "thanks"},)
    assert judged.env_reward == 1.0
    assert judged.judgement == Judgement((1, 1, -1), 1.0, "be brief", (-0.4, -0.9))
    store.mark_trained([seq])
    assert store.count_turns(TurnStatus.TRAINED) == 1 and store.count_turns(TurnStatus.JUDGED) == 0
    store.finish_session("s", outcome_reward=0.5)
    session = store.session("s")
    assert (session.status, session.outcome_reward) == (SessionStatus.DONE, 0.5)


def test_a_judgement_that_arrives_after_an_interruption_leaves_the_turn_dropped(store):
    # the judge read the turn as collected, then its session ended interrupted (a rollout
    # worker died): the late verdict is kept, the turn is not brought back to be trained
    store.add_session(Session("s", "e"))
    store.add_turn(make_turn())
    store.end_turns([("s", 0)])
    store.finish_session("s", 0.0, SessionStatus.INTERRUPTED, reason="the worker died")
    store.set_judgement("s", 0, Judgement(score=1.0))
    ((_, turn),) = store.turns()
    assert turn.status == TurnStatus.DROPPED and turn.judgement == Judgement(score=1.0)
    assert store.count_turns(TurnStatus.JUDGED) == 0


def test_a_session_keeps_why_it_ended_beside_its_metadata(store):
    store.add_session(Session("s", "e", metadata={"user": "u1"}))
    store.finish_session("s", 0.0, SessionStatus.TRUNCATED, reason="context")
    session = store.session("s")
    assert session.status is SessionStatus.TRUNCATED
    assert session.metadata == {"user": "u1", "end_reason": "context"}
    store.add_session(Session("quiet", "e"))
    store.finish_session("quiet")  # no reason: the metadata is left as it was
    assert store.session("quiet").metadata == {}


def test_missing_rows_and_duplicates_are_errors(store):
    with pytest.raises(KeyError):
        store.set_next_state("nope", 0, [])
    with pytest.raises(KeyError):
        store.finish_session("nope")
    store.add_session(Session("s", "e"))
    store.add_turn(make_turn())
    with pytest.raises(Exception, match="UNIQUE"):
        store.add_turn(make_turn())
    assert store.count_turns() == 1


def test_turns_filter_by_type_and_page_by_cursor(store):
    store.add_session(Session("s", "e"))
    seqs = [
        store.add_turn(make_turn(index=i, turn_type=TurnType.SIDE if i % 2 else TurnType.MAIN))
        for i in range(6)
    ]
    assert [t.index for _, t in store.turns(turn_type=TurnType.MAIN)] == [0, 2, 4]
    assert [s for s, _ in store.turns(after_seq=seqs[3])] == seqs[4:]
    assert len(store.turns(limit=2)) == 2


def test_settled_turns_have_a_next_state_or_an_ended_session(store):
    store.add_session(Session("live", "e"))
    store.add_session(Session("ended", "e"))
    for session_id in ("live", "ended"):
        for index in range(3):
            store.add_turn(make_turn(session_id=session_id, index=index))
    store.set_next_state("live", 0, [{"role": "user", "content": "ok"}])
    store.end_turns([("live", 1), ("live", 0)])  # nothing followed 1: settled too
    store.finish_session("ended")
    settled = [(t.session_id, t.index) for _, t in store.turns(settled=True)]
    assert settled == [("live", 0), ("live", 1), ("ended", 0), ("ended", 1), ("ended", 2)]
    assert store.session("live").turns[1].next_state == ()
    assert store.session("live").turns[0].next_state == ({"role": "user", "content": "ok"},)


def test_eight_writer_threads_lose_nothing(store):
    def write(worker):
        store.add_session(Session(f"s{worker}", "e"))
        for index in range(40):
            store.add_turn(make_turn(session_id=f"s{worker}", index=index))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.count_turns() == 320
    assert all(len(store.session(f"s{w}").turns) == 40 for w in range(8))


def writer(path, session_id, count):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.agents.store_writer", str(path), session_id, str(count)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_three_writer_processes_lose_nothing(tmp_path):
    path = tmp_path / "store.sqlite"
    Store(path).close()
    procs = [writer(path, f"p{i}", 60) for i in range(3)]
    reported = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    with Store(path) as store:
        assert store.count_turns() == 180 == sum(len(r) for r in reported)


def test_writer_killed_mid_stream_loses_no_committed_turn(tmp_path):
    path = tmp_path / "store.sqlite"
    proc = writer(path, "victim", 1_000_000)
    assert proc.stdout is not None
    committed = [int(proc.stdout.readline()) for _ in range(200)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    with Store(path) as store:
        stored = {seq for seq, _ in store.turns()}
        assert set(committed) <= stored
        assert len(stored) >= 200
        session = store.session("victim")
        assert [t.index for t in session.turns] == list(range(len(session.turns)))
        assert session.turns[150].completion_token_ids == (150, 7)


def test_parquet_export_reads_back_equal(store, tmp_path):
    store.add_session(Session("s", "clawgym/Arith-v0", task_id="t", group_id="g"))
    store.add_turn(make_turn())
    store.add_turn(make_turn(index=1, completion_token_ids=(9,), completion_logprobs=(-2.5,)))
    store.set_next_state("s", 0, [{"role": "tool", "content": "4"}], env_reward=-1.0)
    store.set_judgement(
        "s", 1, Judgement(votes=(1, 0), score=0.0, hint=None, teacher_logprobs=(-1.5,))
    )
    path = store.export_parquet(tmp_path / "out" / "turns.parquet")
    read_back = datasets.Dataset.from_parquet(str(path)).to_list()
    assert read_back == list(store.iter_rows())
    assert read_back[1]["teacher_logprobs"] == [-1.5] and read_back[0]["env_reward"] == -1.0


def test_the_export_carries_each_positions_top_k_and_the_hint_candidates(store, tmp_path):
    """Schema 3's columns leave in the parquet export and come back with an import."""
    store.add_session(Session("s", "clawgym/Chat-v0", task_id="t", group_id="g"))
    turn = make_turn(
        completion_top_ids=((4, 7, 2), (5, 4, 9)),
        completion_top_logprobs=((-0.5, -1.75, -2.0), (-1.25, -1.5, -3.0)),
    )
    store.add_turn(turn)
    store.add_turn(make_turn(index=1))  # kept no top-k
    candidates = ("Answer in French.", "Be brief, please.")
    judgement = Judgement(
        (1, 1), 1.0, candidates[1], (-0.2, -0.4), hint_candidates=candidates, hint_overlaps=(3, 5)
    )
    store.set_judgement("s", 0, judgement)
    path = store.export_parquet(tmp_path / "turns.parquet")
    first, second = datasets.Dataset.from_parquet(str(path)).to_list()
    assert first["completion_top_ids"] == [[4, 7, 2], [5, 4, 9]]
    assert first["completion_top_logprobs"] == [[-0.5, -1.75, -2.0], [-1.25, -1.5, -3.0]]
    assert (first["hint_candidates"], first["hint_overlaps"]) == (list(candidates), [3, 5])
    assert second["completion_top_ids"] == second["completion_top_logprobs"] == []
    with Store(tmp_path / "other.sqlite") as other:
        assert import_parquet(other, path) == 2
        copied = other.session("s").turns[0]
    assert copied.completion_top_ids == turn.completion_top_ids
    assert copied.completion_top_logprobs == turn.completion_top_logprobs


def test_export_of_an_empty_store_is_an_error(store, tmp_path):
    with pytest.raises(ValueError, match="no turns"):
        store.export_parquet(tmp_path / "x.parquet")


def test_closed_store_refuses_work(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.count_turns()


FIXTURES = Path(__file__).parent / "fixtures"


def test_a_store_written_by_schema_1_opens_migrated_with_every_turn_kept(tmp_path):
    """store_v1.sqlite was written by clawgym's store at schema 1 (before top-k columns):
    two turns, the first judged with a hint and teacher log-probs."""
    import shutil
    import sqlite3

    from agents.store_migrations import SCHEMA_VERSION

    path = tmp_path / "old.sqlite"
    shutil.copy(FIXTURES / "store_v1.sqlite", path)
    with Store(path) as store:
        (_, first), (_, second) = store.turns()
        assert first.completion_token_ids == (4, 5) and first.completion_logprobs == (-0.5, -1.25)
        assert first.judgement == Judgement((-1,), -1.0, "Keep it short.", (-0.25, -0.5))
        assert first.next_state == ({"role": "user", "content": "shorter please"},)
        assert second.completion_top_ids == second.completion_top_logprobs == ()
        # the migrated store takes new turns with their top-k
        top = make_turn(
            index=2,
            completion_top_ids=((4, 9), (5, 4)),
            completion_top_logprobs=((-0.5, -1.0), (-1.25, -2.0)),
        )
        store.add_turn(top)
        assert store.turns()[-1][1] == top
    with Store(path):  # opening it again migrates nothing twice
        pass
    version = sqlite3.connect(path).execute("SELECT value FROM meta").fetchone()[0]
    assert int(version) == SCHEMA_VERSION


def test_a_store_newer_than_the_code_is_refused(tmp_path):
    import sqlite3

    path = tmp_path / "new.sqlite"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(ValueError, match="store schema 99.*newer clawgym"):
        Store(path)


def test_top_k_round_trips_and_a_misshapen_top_k_is_refused(store):
    turn = make_turn(
        completion_top_ids=((4, 1, 2), (5, 4, 0)),
        completion_top_logprobs=((-0.5, -1.5, -2.0), (-1.25, -1.5, -3.0)),
    )
    store.add_session(Session("s", "e"))
    store.add_turn(turn)
    assert store.turns()[0][1] == turn
    with pytest.raises(ValueError, match="top-k ids and log-probs"):
        make_turn(
            completion_top_ids=((4, 1), (5,)), completion_top_logprobs=((-0.5, -1.5), (-1.0,))
        )
    with pytest.raises(ValueError, match="top-k ids and log-probs"):
        make_turn(completion_top_ids=((4, 1),), completion_top_logprobs=((-0.5, -1.5),))


def test_hint_candidates_and_their_overlaps_round_trip(store):
    store.add_session(Session("s", "e"))
    store.add_turn(make_turn(index=0))
    store.add_turn(make_turn(index=1))
    pending = Judgement((1, 1), 1.0, hint_candidates=("Answer in French.", "Use bullet points."))
    chosen = Judgement(
        (1,),
        1.0,
        "Use bullet points.",
        (-0.5, -0.25),
        ("Answer in French.", "Use bullet points."),
        (3, 7),
    )
    store.set_judgement("s", 0, pending)
    store.set_judgement("s", 1, chosen)
    first, second = (turn.judgement for _, turn in store.turns())
    assert first == pending and first.awaits_hint_choice
    assert second == chosen and not second.awaits_hint_choice
    with pytest.raises(ValueError, match="2 overlap scores for 1 hint candidates"):
        Judgement(hint_candidates=("Answer in French.",), hint_overlaps=(1, 2))


def test_a_store_at_schema_2_opens_and_its_judgements_keep_no_candidates(tmp_path):
    """A store as the code before hint candidates wrote it: schema 2, without their
    columns (made here by dropping them from a new store)."""
    import sqlite3

    path = tmp_path / "v2.sqlite"
    with Store(path) as store:
        store.add_session(Session("s", "e"))
        store.add_turn(make_turn())
        store.set_judgement("s", 0, Judgement((-1,), -1.0, "Keep it short.", (-0.25, -0.5)))
    db = sqlite3.connect(path)
    for column in ("hint_candidates", "hint_overlaps"):
        db.execute(f"ALTER TABLE turns DROP COLUMN {column}")
    db.execute("UPDATE meta SET value='2' WHERE key='schema_version'")
    db.commit()
    db.close()
    with Store(path) as store:
        ((_, turn),) = store.turns()
        assert turn.judgement == Judgement((-1,), -1.0, "Keep it short.", (-0.25, -0.5))
        store.set_judgement("s", 0, Judgement((1,), 1.0, hint_candidates=("a", "b")))
        assert store.turns()[0][1].judgement.hint_candidates == ("a", "b")
