"""`clawgym/SWE-v0`: fix a real bug in a real Python project, graded by its tests.

Each episode opens a workspace (`workspace.py`: a container of the project's image, or a
bwrap sandbox) holding the project at /testbed with the instance's bug in place and a git
repository whose only commit is that state. The agent reads the issue, explores and edits
with `bash` and `editor` (view a line range, create, replace a unique string, insert,
undo), and calls `submit`; when the turn budget runs out first, what it has is graded all
the same. Grading (`grading.py`) takes `git diff` of the workspace, applies it to a clean
copy, runs the FAIL_TO_PASS and PASS_TO_PASS tests and lets swebench decide. Reward:
`reward="binary"` gives +1 resolved, otherwise -1 (OpenClaw-RL's SWE track);
`reward="fraction"` gives the fraction of those tests that pass.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from envs.core import (
    Action,
    AgentEnv,
    EpisodeEnd,
    Message,
    ScriptedAgent,
    ToolResult,
    run_episode,
    tool_calls_message,
)
from envs.sandbox import Sandbox, SandboxConfig, SandboxError, close_held
from envs.swe.grading import (
    REWARDS,
    Prediction,
    Report,
    carried_patch,
    grade,
    project_of,
    test_files,
    write_predictions,
)
from envs.swe.instances import SHIPPED, SWEInstance, load_instances, select_split
from envs.swe.sources import TESTBED
from envs.swe.workspace import Workspaces
from envs.tools import Tool, ToolCallError

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository checked out at "
    f"{TESTBED} (a git repository; there is no network). Use the bash tool to explore and "
    "run tests, and the editor tool to view and change files. Change the library's code, "
    "not its tests. When the issue is fixed, call submit: your changes (git diff) are "
    "applied to a clean copy and the project's tests decide."
)
EditorCommand = Literal["view", "create", "str_replace", "insert", "undo_edit"]
_VIEW_LINES = 400


class SWEEnv(AgentEnv):
    """SWE-bench-style issues in sandboxes.

    Args:
        instances: "shipped" (the instances made by `envs/swe/tasks.py`) or the path of a
            SWE-bench-format json / jsonl / parquet file; instances of projects without a
            workspace are left out.
        split: "train", "test" (held out) or "all".
        sandbox: "auto", "bwrap" or "docker".
        max_turns: assistant messages allowed per episode.
        reward: "binary" (+1 resolved, else -1) or "fraction" (of tests passing).
        max_output: bytes of a command's stdout (and of its stderr) the agent sees.
        memory_mb: memory of the workspace.
        command_timeout: seconds one bash command may run.
        test_timeout: seconds the grader's test run may take.
        pool: docker: started containers kept ready per project, so a reset does not wait
            for one (0: none).
    """

    def __init__(
        self,
        instances: str = "shipped",
        split: str = "train",
        sandbox: str = "auto",
        max_turns: int = 20,
        reward: str = "binary",
        max_output: int = 16 * 1024,
        memory_mb: int = 2048,
        command_timeout: float = 60.0,
        test_timeout: float = 300.0,
        pool: int = 1,
    ):
        super().__init__(max_turns=max_turns)
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {reward!r}")
        self.split = split
        self.reward_kind = reward
        self.test_timeout = test_timeout
        self.command_timeout = command_timeout
        path = SHIPPED if instances == "shipped" else Path(instances)
        self.instances = select_split(_runnable(load_instances(path)), split)
        if not self.instances:
            raise ValueError(f"no runnable instance in {path} (split {split})")
        base = SandboxConfig(timeout=command_timeout, max_output=max_output, memory_mb=memory_mb)
        self.workspaces = Workspaces(sandbox, base, pool=pool)
        self.backend = self.workspaces.backend
        self.instance: SWEInstance | None = None
        self.sandbox: Sandbox | None = None
        self._history: dict[str, list[bytes | None]] = {}
        self._report: Report | None = None
        self._model_patch = ""
        self.left_out: list[str] = []

    # -- AgentEnv hooks ------------------------------------------------------------------
    def task_ids(self) -> Sequence[str]:
        return list(self.instances)

    def _load_task(self, task_id: str) -> None:
        close_held(self, "sandbox")
        self.instance = self.instances[task_id]
        project = project_of(self.instance.repo, self.instance.version)
        self.sandbox = self.workspaces.open(project, self.instance.patch)
        self._history = {}
        self._report = None
        self._model_patch = ""
        self.left_out = []

    def _first_messages(self) -> list[Message]:
        assert self.instance is not None
        issue = (
            f"An issue was filed against {self.instance.repo} ({self.instance.version}), "
            f"whose code is at {TESTBED}:\n\n{self.instance.problem_statement}"
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": issue}]

    def _tools(self) -> Sequence[Tool]:
        return (
            Tool.from_function(self.bash),
            Tool.from_function(self.editor),
            Tool.from_function(self.submit),
        )

    def reference_agent(self) -> SWEReferenceAgent:
        return SWEReferenceAgent(self)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"split": self.split, "sandbox": self.backend}
        if self._report is not None:
            info |= {
                "grade": self._report.summary,
                "resolved": self._report.resolved,
                "model_patch": self._model_patch,
                "left_out": list(self.left_out),
            }
        return info

    # -- tools ---------------------------------------------------------------------------
    def bash(self, command: str) -> str:
        """Runs a bash command in the repository's shell and returns its output.

        Args:
            command: bash source, e.g. "grep -rn 'def parse' src" or "python -m pytest -x tests".
        """
        sandbox = self._sandbox()
        try:
            result = sandbox.exec(command, timeout=self.command_timeout)
        except SandboxError as error:
            return f"[error] {error}"
        parts = [result.stdout]
        if result.stderr:
            parts.append(f"[stderr]\n{result.stderr}")
        if result.timed_out:
            parts.append(f"[error] the command was killed after {self.command_timeout:g} s")
        parts.append(f"[exit code {result.exit_code}]")
        return "\n".join(p.rstrip("\n") for p in parts if p)

    def editor(
        self,
        command: EditorCommand,
        path: str,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> str:
        """Views and edits files: view (a file's numbered lines, optionally view_range
        [first, last]; a directory's listing), create (a new file with file_text),
        str_replace (old_str, which must occur exactly once, by new_str), insert (new_str
        after line insert_line; 0 is the top), undo_edit (the last edit of path).

        Args:
            command: view, create, str_replace, insert or undo_edit.
            path: the file or directory, absolute or relative to /testbed.
            file_text: create: the new file's content.
            old_str: str_replace: the exact text to replace.
            new_str: str_replace: the replacement; insert: the text to insert.
            insert_line: insert: the line after which new_str goes.
            view_range: view: [first, last] line numbers (1-based; last -1 for the end).
        """
        path = path if path.startswith("/") else f"{TESTBED}/{path}"
        if command == "view":
            return self._view(path, view_range)
        if command == "undo_edit":
            return self._undo(path)
        if command == "create":
            if file_text is None:
                raise ToolCallError("create needs file_text")
            self._write(path, file_text.encode(), self._read_or_none(path))
            return f"created {path}"
        text = self._read(path)
        if command == "str_replace":
            if old_str is None:
                raise ToolCallError("str_replace needs old_str (and new_str)")
            count = text.count(old_str)
            if count != 1:
                where = "does not occur" if count == 0 else f"occurs {count} times"
                raise ToolCallError(f"old_str {where} in {path}; it must occur exactly once")
            updated = text.replace(old_str, new_str or "", 1)
        else:
            if new_str is None or insert_line is None:
                raise ToolCallError("insert needs insert_line and new_str")
            lines = text.splitlines(keepends=True)
            if not 0 <= insert_line <= len(lines):
                raise ToolCallError(f"insert_line must be in 0..{len(lines)}")
            addition = new_str if new_str.endswith("\n") else new_str + "\n"
            updated = "".join([*lines[:insert_line], addition, *lines[insert_line:]])
        self._write(path, updated.encode(), text.encode())
        start = max(0, updated.find(new_str or "") if command == "str_replace" else 0)
        first = updated.count("\n", 0, start) + 1 if command == "str_replace" else insert_line
        return f"edited {path}; around the change:\n" + _numbered(
            updated, max(1, int(first or 1) - 3), int(first or 1) + 6
        )

    def submit(self) -> ToolResult:
        """Ends the episode: your changes (git diff of /testbed) are graded on a clean copy."""
        report = self._grade()
        text = f"submitted: {report.summary}"
        if self.left_out:
            text += "; kept pristine (tests and test-runner files): " + ", ".join(self.left_out)
        return ToolResult(text, self._reward(report), terminated=True)

    # -- editor internals ----------------------------------------------------------------
    def _view(self, path: str, view_range: list[int] | None) -> str:
        sandbox = self._sandbox()
        probe = sandbox.exec(f"test -d {shlex.quote(path)}", timeout=30)
        if probe.exit_code == 0:
            listing = sandbox.exec(
                f"cd {shlex.quote(path)} && "
                "find . -maxdepth 2 -not -path '*/.git*' | sort | head -300",
                timeout=30,
            )
            return listing.stdout or "(empty directory)"
        text = self._read(path)
        total = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        first, last = 1, min(total, _VIEW_LINES)
        if view_range is not None:
            if len(view_range) != 2:
                raise ToolCallError("view_range is [first, last]")
            first, last = view_range[0], total if view_range[1] == -1 else view_range[1]
            if not 1 <= first <= max(1, total) or last < first:
                raise ToolCallError(f"view_range must be within 1..{total} with first <= last")
        body = _numbered(text, first, last)
        more = f"\n[lines {last + 1}-{total} not shown; use view_range]" if last < total else ""
        return body + more

    def _read_or_none(self, path: str) -> bytes | None:
        try:
            return self._sandbox().read_file(path)
        except SandboxError:
            return None

    def _read(self, path: str) -> str:
        data = self._read_or_none(path)
        if data is None:
            raise ToolCallError(f"{path} does not exist or is not a readable file")
        return data.decode(errors="replace")

    def _write(self, path: str, data: bytes, previous: bytes | None) -> None:
        try:
            self._sandbox().write_file(path, data)
        except SandboxError as error:
            raise ToolCallError(str(error)) from None
        self._history.setdefault(path, []).append(previous)

    def _undo(self, path: str) -> str:
        history = self._history.get(path)
        if not history:
            raise ToolCallError(f"no edit of {path} to undo")
        previous = history.pop()
        if previous is None:
            self._sandbox().exec(f"rm -f {shlex.quote(path)}", timeout=30)
            return f"undone: {path} removed (it was created by the edit)"
        self._sandbox().write_file(path, previous)
        return f"undone: the last edit of {path}"

    # -- episode end ---------------------------------------------------------------------
    def _on_episode_end(self, terminated: bool, truncated: bool) -> EpisodeEnd:
        """An episode the turn budget cut short is graded on what the workspace holds."""
        if truncated and self._report is None:
            return EpisodeEnd(reward=self._reward(self._grade()))
        return EpisodeEnd()

    def _reward(self, report: Report) -> float:
        return report.reward(self.reward_kind)

    def _grade(self) -> Report:
        if self._report is not None:
            return self._report
        assert self.instance is not None
        try:
            self._model_patch = self.model_patch()
        except SandboxError as error:  # a tree past its budget, nested too deep
            reason = f"not graded: {error}"
            self._report = Report(
                self.instance.instance_id, False, "RESOLVED_NO", False, reason=reason
            )
            logger.info("%s: %s", self.instance.instance_id, self._report.summary)
            return self._report
        self._report = grade(self.workspaces, self.instance, self._model_patch, self.test_timeout)
        logger.info("%s: %s", self.instance.instance_id, self._report.summary)
        return self._report

    @property
    def report(self) -> Report | None:
        """The grade of the episode once it ended."""
        return self._report

    @property
    def submitted_patch(self) -> str:
        """The patch that was graded (empty before the episode ended)."""
        return self._model_patch

    def model_patch(self) -> str:
        """The agent's change so far, as the grader takes it (`grading.carried_patch`): its
        /testbed carried into a fresh workspace and diffed there, without the test and
        test-runner files it may not change (those are in `left_out`)."""
        assert self.instance is not None
        tree = self._sandbox().export_tree(TESTBED)  # kills what the agent left running
        patch, self.left_out = carried_patch(self.workspaces, self.instance, tree)
        return patch

    # -- sandboxes -----------------------------------------------------------------------
    def _sandbox(self) -> Sandbox:
        if self.sandbox is None:
            raise ToolCallError("no task is loaded; call reset() first")
        return self.sandbox

    def close(self) -> None:
        close_held(self, "sandbox")
        self.workspaces.close()
        super().close()


def _runnable(instances: list[SWEInstance]) -> list[SWEInstance]:
    """The instances whose project has a workspace here."""
    kept = []
    for instance in instances:
        try:
            project_of(instance.repo, instance.version)
        except ValueError:
            continue
        kept.append(instance)
    if len(kept) < len(instances):
        skipped = len(instances) - len(kept)
        logger.info("%d of %d instances have no workspace here", skipped, len(instances))
    return kept


def _numbered(text: str, first: int, last: int) -> str:
    lines = text.splitlines()
    return "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(first, min(last, len(lines)) + 1))


class SWEReferenceAgent:
    """Scripted reference solver, played the way an engineer would and the policy could
    learn to: look at the repository (`bash`), make the gold patch's changes with the
    editor (`str_replace` of each hunk's old lines by its new ones; `git apply` of the
    patch where a hunk's old text is not unique in its file), run the failing tests, then
    submit. It reads the instance from the env; the turn in `info` says where it is."""

    def __init__(self, env: SWEEnv):
        self.env = env

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        instance = self.env.instance
        assert instance is not None
        turn = int(info.get("turn", 0))
        if turn == 0:
            return tool_calls_message([("bash", {"command": f"cd {TESTBED} && git status && ls"})])
        if turn == 1:
            edits = self._edits(instance.patch)
            if edits is None:
                command = (
                    f"cd {TESTBED} && git apply <<'__GOLD_PATCH__'\n{instance.patch}__GOLD_PATCH__"
                )
                return tool_calls_message([("bash", {"command": command})])
            return tool_calls_message(
                [
                    ("editor", {"command": "str_replace", "path": p, "old_str": o, "new_str": n})
                    for p, o, n in edits
                ]
            )
        if turn == 2:
            files = " ".join(test_files(instance.fail_to_pass))
            command = f"cd {TESTBED} && python3 -m pytest -q -x {files} 2>&1 | tail -5"
            return tool_calls_message([("bash", {"command": command})])
        return tool_calls_message([("submit", {})])

    def _edits(self, patch: str) -> list[tuple[str, str, str]] | None:
        """(path, old, new) of each hunk, or None where one cannot be a unique replacement."""
        edits = []
        for path, old, new in patch_hunks(patch):
            try:
                text = self.env.sandbox.read_file(f"{TESTBED}/{path}") if self.env.sandbox else b""
            except SandboxError:
                return None
            if not old or text.decode(errors="replace").count(old) != 1:
                return None
            edits.append((path, old, new))
        return edits or None


def patch_hunks(patch: str) -> list[tuple[str, str, str]]:
    """(path, old text, new text) of every hunk of a unified diff, context lines included."""
    hunks: list[tuple[str, str, str]] = []
    path, old, new = "", list[str](), list[str]()

    def close() -> None:
        if old or new:
            hunks.append((path, "".join(old), "".join(new)))
        old.clear()
        new.clear()

    for line in patch.splitlines(keepends=True):
        if line.startswith("+++ "):
            close()
            path = line[4:].strip().removeprefix("b/")
        elif line.startswith(("--- ", "diff --git", "index ")):
            close()
        elif line.startswith("@@"):
            close()
        elif line.startswith("+"):
            new.append(line[1:])
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith(" "):
            old.append(line[1:])
            new.append(line[1:])
    close()
    return hunks


def evaluate(
    env: SWEEnv, agent: ScriptedAgent, task_ids: Sequence[str], model: str, folder: Path
) -> list[Report]:
    """Plays one episode per task and writes SWE-bench predictions and a report in `folder`."""
    predictions, reports = [], []
    for task_id in task_ids:
        run_episode(env, agent, task_id=task_id)
        report = env.report
        assert report is not None
        predictions.append(Prediction(task_id, model, env.submitted_patch))
        reports.append(report)
    write_predictions(folder, predictions, reports)
    return reports
