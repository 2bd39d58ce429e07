"""Trees carried between sandboxes (envs/sandbox/trees.py), on both backends: what the agent
made in a directory arrives in a fresh sandbox, and nothing else does: no fifo, no device,
no link followed, no tree past its budget, and a deep tree is refused with a reason."""

import io
import tarfile

import pytest

from envs.sandbox import SandboxConfig, SandboxError, make_sandbox
from envs.sandbox.trees import MAX_TREE_DEPTH, filter_archive, members, read_member

CONFIG = SandboxConfig(timeout=20.0, writable=("/workspace",))


def test_a_tree_moves_to_a_fresh_sandbox_without_its_fifos_or_processes(backend):
    with make_sandbox(backend, CONFIG) as agent, make_sandbox(backend, CONFIG) as fresh:
        agent.start()
        made = agent.exec(
            "cd /workspace && mkdir -p pkg/sub && printf 'x = 1\\n' > pkg/sub/mod.py && "
            "printf '#!/bin/sh\\necho hi\\n' > run.sh && chmod 755 run.sh && "
            "ln -s /etc/passwd leak && mkfifo pipe && "
            "(sleep 300 &) && echo done",
            timeout=20,
        )
        assert made.stdout.strip() == "done", made
        archive = agent.export_tree("/workspace")
        names = {m.name for m in members(archive)}
        assert {"pkg", "pkg/sub", "pkg/sub/mod.py", "run.sh", "leak"} <= names
        assert "pipe" not in names
        assert read_member(archive, "pkg/sub/mod.py") == b"x = 1\n"
        fresh.start()
        fresh.import_tree("/workspace", archive)
        shown = fresh.exec(
            "cd /workspace && cat pkg/sub/mod.py && ./run.sh && readlink leak && "
            "test ! -e pipe && echo no-fifo; pgrep -fc 'sleep 300' || true",
            timeout=20,
        )
        assert shown.stdout.split() == ["x", "=", "1", "hi", "/etc/passwd", "no-fifo", "0"]


def test_a_tree_nested_past_the_depth_limit_is_refused_with_a_reason(backend):
    with make_sandbox(backend, CONFIG) as agent:
        agent.start()
        deep = "/".join(["d"] * (MAX_TREE_DEPTH + 20))
        assert agent.exec(f"cd /workspace && mkdir -p {deep}", timeout=20).exit_code == 0
        with pytest.raises(SandboxError, match="deeper than"):
            agent.export_tree("/workspace")


def test_a_missing_directory_is_an_empty_tree(backend):
    with make_sandbox(backend, CONFIG) as agent:
        agent.start()
        assert members(agent.export_tree("/workspace/nothing-here")) == []


def test_filter_keeps_only_files_directories_and_links_inside():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind in [
            ("top/a.py", tarfile.REGTYPE),
            ("top/dev", tarfile.CHRTYPE),
            ("top/fifo", tarfile.FIFOTYPE),
            ("top/../escape", tarfile.REGTYPE),
            ("top/.git/config", tarfile.REGTYPE),
        ]:
            info = tarfile.TarInfo(name)
            info.type = kind
            tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    kept = filter_archive(buffer.getvalue(), "top", lambda n: not n.startswith(".git"), strip=1)
    assert [m.name for m in members(kept)] == ["a.py"]
