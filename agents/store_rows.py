"""How the trajectory store (`agents.store`) writes turns and sessions as SQLite rows and
reads them back, and the flat rows it exports.
"""

from __future__ import annotations

import array
import json
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

from agents.store_images import ImageFiles
from agents.trajectory import Judgement, Session, SessionStatus, Turn, TurnStatus, TurnType

# Token ids as little-endian int32, log-probs as little-endian float64 (an exact round trip
# of Python floats). The array module packs them: numpy cost twice as much on the proxy's
# commit, where caches are cold after the engine's forward pass (measured).
_IDS, _LOGPROBS = "i", "d"
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack(values: Sequence[float] | Sequence[int] | None, typecode: str) -> bytes | None:
    if values is None:
        return None
    packed = array.array(typecode, values)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _unpack(blob: bytes, typecode: str) -> tuple[Any, ...]:
    values = array.array(typecode)
    values.frombytes(blob)
    if not _LITTLE_ENDIAN:
        values.byteswap()
    return tuple(values)


def _unpack_ids(blob: bytes) -> tuple[int, ...]:
    return _unpack(blob, _IDS)


def _unpack_logprobs(blob: bytes | None) -> tuple[float, ...] | None:
    return None if blob is None else _unpack(blob, _LOGPROBS)


def to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def pack_logprobs(values: Sequence[float] | None) -> bytes | None:
    """Log-probs as the store keeps them (little-endian float64)."""
    return _pack(values, _LOGPROBS)


TURN_COLUMNS = (
    "session_id, idx, turn_type, prompt_messages, prompt_token_ids, completion_token_ids, "
    "completion_logprobs, completion, policy_version, tools, next_state, env_reward, votes, "
    "score, hint, teacher_logprobs, status, created_at, completion_top_ids, "
    "completion_top_logprobs, hint_candidates, hint_overlaps"
)
"""The columns `turn_values` fills, in its order."""
INSERT_TURN = (
    f"INSERT INTO turns ({TURN_COLUMNS}) VALUES ({', '.join('?' * (TURN_COLUMNS.count(',') + 1))})"
)


def turn_values(turn: Turn, images: ImageFiles) -> tuple[Any, ...]:
    """A turn's row; its images are kept in `images`, the row references them."""
    judgement = turn.judgement
    return (
        turn.session_id,
        turn.index,
        str(turn.turn_type),
        json.dumps(images.stash(turn.prompt_messages)),
        _pack(turn.prompt_token_ids, _IDS),
        _pack(turn.completion_token_ids, _IDS),
        _pack(turn.completion_logprobs, _LOGPROBS),
        json.dumps(turn.completion),
        turn.policy_version,
        json.dumps(list(turn.tools)),
        to_json(None if turn.next_state is None else images.stash(turn.next_state)),
        turn.env_reward,
        to_json(None if judgement is None else list(judgement.votes)),
        None if judgement is None else judgement.score,
        None if judgement is None else judgement.hint,
        None if judgement is None else _pack(judgement.teacher_logprobs, _LOGPROBS),
        str(turn.status),
        turn.created_at,
        _pack([i for top in turn.completion_top_ids for i in top] or None, _IDS),
        _pack([lp for top in turn.completion_top_logprobs for lp in top] or None, _LOGPROBS),
        *hint_choice_values(judgement),
    )


def hint_choice_values(judgement: Judgement | None) -> tuple[str | None, str | None]:
    """The hint candidates and their overlap scores as the store keeps them (JSON)."""
    if judgement is None:
        return None, None
    return to_json(list(judgement.hint_candidates)), to_json(list(judgement.hint_overlaps))


def _unpack_top(blob: bytes | None, typecode: str, tokens: int) -> tuple[tuple[Any, ...], ...]:
    """A turn's top-k rows from their flat blob (k values per completion token)."""
    if blob is None or not tokens:
        return ()
    flat = _unpack(blob, typecode)
    k = len(flat) // tokens
    return tuple(flat[i : i + k] for i in range(0, len(flat), k))


def turn_from_row(row: sqlite3.Row, images: ImageFiles) -> Turn:
    """A turn from its row, with the images it references read back from `images`."""
    judgement = None
    if row["votes"] is not None:
        judgement = Judgement(
            votes=tuple(json.loads(row["votes"])),
            score=float(row["score"]),
            hint=row["hint"],
            teacher_logprobs=_unpack_logprobs(row["teacher_logprobs"]),
            hint_candidates=tuple(json.loads(row["hint_candidates"] or "[]")),
            hint_overlaps=tuple(json.loads(row["hint_overlaps"] or "[]")),
        )
    next_state = row["next_state"]
    completion_ids = _unpack_ids(row["completion_token_ids"])
    tokens = len(completion_ids)
    return Turn(
        session_id=row["session_id"],
        index=int(row["idx"]),
        turn_type=TurnType(row["turn_type"]),
        prompt_messages=tuple(images.restore(json.loads(row["prompt_messages"]))),
        prompt_token_ids=_unpack_ids(row["prompt_token_ids"]),
        completion_token_ids=completion_ids,
        completion_logprobs=_unpack_logprobs(row["completion_logprobs"]) or (),
        completion_top_ids=_unpack_top(row["completion_top_ids"], _IDS, tokens),
        completion_top_logprobs=_unpack_top(row["completion_top_logprobs"], _LOGPROBS, tokens),
        completion=json.loads(row["completion"]),
        policy_version=int(row["policy_version"]),
        tools=tuple(json.loads(row["tools"])),
        next_state=None if next_state is None else tuple(images.restore(json.loads(next_state))),
        env_reward=row["env_reward"],
        judgement=judgement,
        status=TurnStatus(row["status"]),
        created_at=float(row["created_at"]),
    )


def session_from_row(row: sqlite3.Row, turns: tuple[Turn, ...]) -> Session:
    return Session(
        session_id=row["session_id"],
        env_id=row["env_id"],
        task_id=row["task_id"],
        group_id=row["group_id"],
        turns=turns,
        outcome_reward=row["outcome_reward"],
        status=SessionStatus(row["status"]),
        created_at=float(row["created_at"]),
        metadata=json.loads(row["metadata"]),
    )


def export_features() -> Any:
    import datasets

    value, seq = datasets.Value, datasets.List
    return datasets.Features(
        {
            "seq": value("int64"),
            "session_id": value("string"),
            "env_id": value("string"),
            "task_id": value("string"),
            "group_id": value("string"),
            "outcome_reward": value("float64"),
            "index": value("int32"),
            "turn_type": value("string"),
            "prompt_messages": value("string"),
            "prompt_token_ids": seq(value("int32")),
            "completion_token_ids": seq(value("int32")),
            "completion_logprobs": seq(value("float64")),
            "completion": value("string"),
            "policy_version": value("int32"),
            "tools": value("string"),
            "next_state": value("string"),
            "env_reward": value("float64"),
            "votes": seq(value("int8")),
            "score": value("float64"),
            "hint": value("string"),
            "teacher_logprobs": seq(value("float64")),
            "completion_top_ids": seq(seq(value("int32"))),
            "completion_top_logprobs": seq(seq(value("float64"))),
            "hint_candidates": seq(value("string")),
            "hint_overlaps": seq(value("int32")),
            "status": value("string"),
            "created_at": value("float64"),
        }
    )


def export_row(row: sqlite3.Row, images: ImageFiles) -> dict[str, Any]:
    """One turn's flat row, joined with its session, for analysis and SFT (its images
    inline again, as data URLs)."""
    turn = turn_from_row(row, images)
    judgement = turn.judgement or Judgement()
    return {
        "seq": int(row["seq"]),
        "session_id": turn.session_id,
        "env_id": row["env_id"],
        "task_id": row["task_id"],
        "group_id": row["group_id"],
        "outcome_reward": row["outcome_reward"],
        "index": turn.index,
        "turn_type": str(turn.turn_type),
        "prompt_messages": json.dumps(list(turn.prompt_messages)),
        "prompt_token_ids": list(turn.prompt_token_ids),
        "completion_token_ids": list(turn.completion_token_ids),
        "completion_logprobs": list(turn.completion_logprobs),
        "completion": json.dumps(turn.completion),
        "policy_version": turn.policy_version,
        "tools": json.dumps(list(turn.tools)),
        "next_state": None if turn.next_state is None else json.dumps(list(turn.next_state)),
        "env_reward": turn.env_reward,
        "votes": list(judgement.votes),
        "score": judgement.score if turn.judgement else None,
        "hint": judgement.hint,
        "teacher_logprobs": None
        if judgement.teacher_logprobs is None
        else list(judgement.teacher_logprobs),
        # per completion position, its top-k ids and log-probs, likeliest first ([] unkept)
        "completion_top_ids": [list(top) for top in turn.completion_top_ids],
        "completion_top_logprobs": [list(top) for top in turn.completion_top_logprobs],
        "hint_candidates": list(judgement.hint_candidates),
        "hint_overlaps": list(judgement.hint_overlaps),
        "status": str(turn.status),
        "created_at": turn.created_at,
    }
