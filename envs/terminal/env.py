"""`clawgym/Terminal-v0`: real bash tasks in a sandbox, with the tools `bash` and `submit`.

Each episode gets a fresh sandbox (bubblewrap or Docker; "auto" picks Docker when a daemon
answers), set up by the task's script. The agent runs commands with `bash` (one persistent
shell: `cd` and `export` carry over) and ends with `submit`; when the turn budget runs out
first, the task is graded all the same. Task sets are in `tasks.py` and `harbor.py`
(`load_task_set` picks one by name), graders in `grading.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from envs.core import Action, AgentEnv, EpisodeEnd, Message, ToolResult, tool_calls_message
from envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    close_held,
    closed_on_failure,
    make_sandbox,
    resolve_backend,
)
from envs.terminal.grading import (
    Run,
    Verdict,
    grade_harbor,
    grade_icalfa,
    grade_tbench,
    prepare,
    run_gold,
    snapshot,
    unstable_paths,
)
from envs.terminal.harbor import build_image, for_backend, load_harbor, shipped_harbor
from envs.terminal.tasks import (
    SHIPPED,
    TerminalTask,
    load_icalfa,
    load_tbench,
    select_split,
)
from envs.tools import Tool

SYSTEM_PROMPT = (
    "You are working in a Linux shell (bash) without network access. Run commands with the "
    "bash tool; the shell keeps its working directory and variables between calls. When the "
    "task is done, call submit."
)


class TerminalEnv(AgentEnv):
    """Bash tasks in a sandbox.

    Args:
        tasks: "tbench" (the shipped terminal-bench-format tasks), "icalfa" (InterCode-ALFA's
            300 tasks), "harbor" (the shipped tasks as Harbor folders), "harbor:PATH" (a
            folder of Harbor task folders) or the path of a directory of
            terminal-bench-format tasks.
        split: "train", "test" (held out) or "all".
        sandbox: "auto", "bwrap" or "docker".
        max_turns: assistant messages allowed per episode.
        max_output: bytes of a command's stdout (and of its stderr) the agent sees.
        memory_mb: memory of the sandbox.
        pool: started sandboxes kept ready per sandbox layout, so that a reset does not
            wait for one to start (0: none; each spare holds a container or namespace).
    """

    def __init__(
        self,
        tasks: str = "tbench",
        split: str = "train",
        sandbox: str = "auto",
        max_turns: int = 10,
        max_output: int = 16 * 1024,
        memory_mb: int = 1024,
        pool: int = 0,
    ):
        super().__init__(max_turns=max_turns)
        self.task_set = tasks
        self.split = split
        self.backend = resolve_backend(sandbox)
        self.tasks = {
            k: for_backend(t, self.backend) for k, t in load_task_set(tasks, split).items()
        }
        self.base_config = SandboxConfig(max_output=max_output, memory_mb=memory_mb)
        self.pool_size = pool
        self._pools: dict[SandboxConfig, SandboxPool] = {}
        self.task: TerminalTask | None = None
        self.sandbox: Sandbox | None = None
        self._baseline: dict[str, str] = {}
        self._last_run: Run | None = None
        self._verdict: Verdict | None = None

    # -- AgentEnv hooks ------------------------------------------------------------------
    def task_ids(self) -> Sequence[str]:
        return list(self.tasks)

    def _load_task(self, task_id: str) -> None:
        close_held(self, "sandbox")
        self.task = self.tasks[task_id]
        self.sandbox = self._make_sandbox(self.task)
        prepare(self.sandbox, self.task)
        self._baseline = snapshot(self.sandbox, self.task.writable) if self._is_icalfa else {}
        self._last_run = None
        self._verdict = None

    def _first_messages(self) -> list[Message]:
        assert self.task is not None
        where = f"The shell starts in {self.task.workdir}."
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{self.task.instruction}\n\n{where}"},
        ]

    def _tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.bash), Tool.from_function(self.submit))

    def reference_agent(self) -> TerminalReferenceAgent:
        return TerminalReferenceAgent(self)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"split": self.split, "sandbox": self.backend}
        if self._verdict is not None:
            info["grade"] = self._verdict.summary
        return info

    # -- tools ---------------------------------------------------------------------------
    def bash(self, command: str) -> str:
        """Runs a bash command in the task's shell and returns its output.

        Args:
            command: bash source, e.g. "ls -la" or a multi-line script.
        """
        assert self.sandbox is not None and self.task is not None
        try:
            result = self.sandbox.exec(command, timeout=self.task.command_timeout)
        except SandboxError as error:
            return f"[error] {error}"
        if self._is_icalfa:
            self._last_run = Run(command, result.stdout + result.stderr, {}, {})
        parts = [result.stdout]
        if result.stderr:
            parts.append(f"[stderr]\n{result.stderr}")
        if result.timed_out:
            parts.append(
                f"[error] the command was killed after {self.task.command_timeout:g} s "
                "(time limit); the shell is ready for the next command"
            )
        elif result.shell_restarted:
            parts.append("[note] the shell exited; a new one started in the same directory")
        parts.append(f"[exit code {result.exit_code}]")
        return "\n".join(p.rstrip("\n") for p in parts if p)

    def submit(self) -> ToolResult:
        """Ends the episode: the task is graded as the sandbox stands now."""
        verdict = self._grade()
        return ToolResult(f"submitted: {verdict.summary}", verdict.reward, terminated=True)

    # -- episode end ---------------------------------------------------------------------
    def _on_episode_end(self, terminated: bool, truncated: bool) -> EpisodeEnd:
        """An episode the turn budget cut short is graded as the sandbox stands."""
        if truncated and self._verdict is None:
            return EpisodeEnd(reward=self._grade().reward)
        return EpisodeEnd()

    def _grade(self) -> Verdict:
        assert self.sandbox is not None and self.task is not None
        if self._verdict is not None:
            return self._verdict
        if self._is_icalfa:
            agent = self._last_run
            if agent is not None:
                self.sandbox.restart_shell()
                agent = replace(
                    agent, before=self._baseline, after=snapshot(self.sandbox, self.task.writable)
                )
            self._verdict = self._grade_icalfa(agent)
        elif self.task.kind == "harbor":
            self._verdict = grade_harbor(self._make_sandbox, self.sandbox, self.task)
        else:
            self._verdict = grade_tbench(self._make_sandbox, self.sandbox, self.task)
        return self._verdict

    def _grade_icalfa(self, agent: Run | None) -> Verdict:
        assert self.task is not None
        gold = run_gold(self._make_sandbox, self.task)
        verdict = grade_icalfa(agent, gold)
        if verdict.details.get("content_mismatch"):
            again = run_gold(self._make_sandbox, self.task)
            verdict = grade_icalfa(agent, gold, unstable_paths(gold, again))
        return verdict

    # -- sandboxes -----------------------------------------------------------------------
    @property
    def _is_icalfa(self) -> bool:
        return self.task is not None and self.task.kind == "icalfa"

    def _make_sandbox(self, task: TerminalTask) -> Sandbox:
        config = replace(
            self.base_config,
            workdir=task.workdir,
            writable=task.writable,
            readonly=("/tests",) if task.kind in ("tbench", "harbor") else (),
            timeout=task.command_timeout,
            env=task.env,
        )
        if task.environment and self.backend == "docker":  # its own image: no pool
            from envs.sandbox.docker import DockerSandbox

            with closed_on_failure(DockerSandbox(config, build_image(task.environment))) as box:
                box.start()
            return box
        if self.pool_size:
            if config not in self._pools:
                self._pools[config] = SandboxPool(self.backend, config, self.pool_size)
            return self._pools[config].take()
        with closed_on_failure(make_sandbox(self.backend, config)) as sandbox:
            sandbox.start()
        return sandbox

    def close(self) -> None:
        close_held(self, "sandbox")
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()
        super().close()


def load_task_set(source: str, split: str) -> dict[str, TerminalTask]:
    """The tasks of `source` ("tbench", "icalfa", "harbor", "harbor:PATH" or a task
    directory) in `split`."""
    if source == "harbor" or source.startswith("harbor:"):
        path = source.partition(":")[2] or str(shipped_harbor())
        return select_split(list(load_harbor(path)), split)
    if source == "icalfa":
        return select_split(list(load_icalfa()), split)
    directory = SHIPPED if source == "tbench" else Path(source)
    return select_split(list(load_tbench(str(directory))), split)


class TerminalReferenceAgent:
    """Scripted reference solver: runs the task's reference solution (the gold command for
    InterCode-ALFA) with one `bash` call, then submits. It reads the task from the env."""

    def __init__(self, env: TerminalEnv):
        self.env = env

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        task = self.env.task
        assert task is not None
        if observation and observation[-1].get("name") == "bash":
            return tool_calls_message([("submit", {})])
        return tool_calls_message([("bash", {"command": task.solution})])
