"""SWE task instances in SWE-bench's format, the shipped set and the loader.

An instance is SWE-bench's record: `instance_id`, `repo`, `version`, `base_commit`,
`problem_statement`, `patch` (the fix), `test_patch`, `FAIL_TO_PASS` and `PASS_TO_PASS`
(lists, or JSON-encoded lists as the hub's files hold them). The shipped set
(`data/instances.jsonl`) was made by `envs/swe/tasks.py` from the projects of `sources.py`;
`load_instances` reads that file or any SWE-bench-format json / jsonl / parquet file, such
as SWE-bench Lite, the same way. Every fifth instance by sorted id hash is held out as the
"test" split.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).resolve().parent / "data" / "instances.jsonl"
SPLITS = ("train", "test", "all")


@dataclass(frozen=True)
class SWEInstance:
    """One SWE-bench-format instance.

    Attributes:
        instance_id: unique id, `<owner>__<repo>-<version>.<hash>` for generated ones.
        repo: `owner/name` of the project.
        version: the project's version (one workspace image per repo and version).
        base_commit: the source the workspace starts from (for generated instances, the
            sdist's digest).
        problem_statement: the issue, as a user reports it.
        patch: the fix (a unified diff against the buggy tree).
        test_patch: tests added by the fix (empty for generated instances, whose failing
            tests are already in the project's suite).
        fail_to_pass: tests that fail before the fix and pass after it.
        pass_to_pass: tests that pass before and after.
        meta: anything else the source file carried (e.g. how the bug was made).
    """

    instance_id: str
    repo: str
    version: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_record(self) -> dict[str, Any]:
        """The SWE-bench record (lists as lists)."""
        record = asdict(self)
        meta = record.pop("meta")
        record["FAIL_TO_PASS"] = list(record.pop("fail_to_pass"))
        record["PASS_TO_PASS"] = list(record.pop("pass_to_pass"))
        return record | meta

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> SWEInstance:
        """Reads a SWE-bench record; raises ValueError naming a missing field."""
        required = ("instance_id", "repo", "patch", "FAIL_TO_PASS", "PASS_TO_PASS")
        absent = [k for k in required if k not in record]
        if absent:
            raise ValueError(f"a SWE-bench instance needs {', '.join(absent)}")
        known = {
            "instance_id",
            "repo",
            "version",
            "base_commit",
            "problem_statement",
            "patch",
            "test_patch",
            "FAIL_TO_PASS",
            "PASS_TO_PASS",
        }
        return cls(
            instance_id=str(record["instance_id"]),
            repo=str(record["repo"]),
            version=str(record.get("version") or ""),
            base_commit=str(record.get("base_commit") or ""),
            problem_statement=str(record.get("problem_statement") or ""),
            patch=str(record["patch"]),
            test_patch=str(record.get("test_patch") or ""),
            fail_to_pass=_tests(record["FAIL_TO_PASS"]),
            pass_to_pass=_tests(record["PASS_TO_PASS"]),
            meta={k: v for k, v in record.items() if k not in known},
        )


def _tests(value: Any) -> tuple[str, ...]:
    """A test list, given as a list or as the JSON string the hub's files hold."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return tuple(str(v) for v in value)


def load_instances(path: str | Path = SHIPPED) -> list[SWEInstance]:
    """Instances from a .json (a list), .jsonl or .parquet file (optionally .gz)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no instance file at {path}")
    suffixes = path.suffixes
    if ".parquet" in suffixes:
        import pyarrow.parquet as pq

        records: Iterable[dict[str, Any]] = pq.read_table(path).to_pylist()
    else:
        opener = gzip.open if suffixes[-1:] == [".gz"] else open
        with opener(path, "rt", encoding="utf-8") as handle:
            text = handle.read()
        if ".jsonl" in suffixes:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            loaded = json.loads(text)
            records = loaded if isinstance(loaded, list) else [loaded]
    return [SWEInstance.from_record(r) for r in records]


def save_instances(path: Path, instances: Sequence[SWEInstance]) -> None:
    """Writes instances as jsonl, sorted by id (so a rebuild diffs cleanly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(i.to_record(), sort_keys=True) for i in sorted(instances, key=_id)]
    path.write_text("\n".join(lines) + "\n")


def _id(instance: SWEInstance) -> str:
    return instance.instance_id


def in_test_split(instance_id: str) -> bool:
    """Held out: one instance in five, by a hash of its id (stable as the set grows)."""
    return int(hashlib.sha256(instance_id.encode()).hexdigest(), 16) % 5 == 0


def select_split(instances: Iterable[SWEInstance], split: str) -> dict[str, SWEInstance]:
    """The instances of `split` ("train", "test" or "all"), by id."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return {
        i.instance_id: i
        for i in sorted(instances, key=_id)
        if split == "all" or in_test_split(i.instance_id) == (split == "test")
    }
