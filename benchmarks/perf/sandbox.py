"""Sandbox latency: reset (a new sandbox with its shell ready) and one command in the
persistent shell, p50 / p99, for bwrap and docker, against a fresh `docker exec` per
command as the baseline; and the terminal env's steps/s with several envs in parallel.

    python -m benchmarks.perf.sandbox [--commands 200] [--resets 20] [--envs 8]
                                      [--backends bwrap,docker]

Starts dockerd (as root) when none answers and stops it afterwards. Prints one table;
`ratio` is the baseline's p50 over the row's p50, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from envs.sandbox import SandboxConfig, SandboxError, SandboxPool, make_sandbox
from envs.terminal.env import TerminalEnv

Row = tuple[str, list[float] | None, str, str]  # case, seconds per op, rate, target


def timings(operation: Callable[[], object], count: int) -> list[float]:
    """Seconds taken by each of `count` calls of `operation`."""
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        operation()
        taken.append(time.perf_counter() - started)
    return taken


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reset_timings(backend: str, count: int) -> list[float]:
    """A new sandbox until its shell answers; closing is not counted."""
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        sandbox = make_sandbox(backend, SandboxConfig())
        sandbox.start()
        taken.append(time.perf_counter() - started)
        sandbox.close()
    return taken


def pooled_reset_timings(backend: str, count: int, spares: int = 2) -> list[float]:
    """Taking a started sandbox from a pool whose spares are ready (as between episodes that
    last longer than a sandbox takes to start)."""
    pool = SandboxPool(backend, SandboxConfig(), spares)
    taken = []
    try:
        for _ in range(count):
            deadline = time.monotonic() + 60
            while pool.ready() < spares and time.monotonic() < deadline:
                time.sleep(0.01)
            started = time.perf_counter()
            sandbox = pool.take()
            taken.append(time.perf_counter() - started)
            sandbox.close()
    finally:
        pool.close()
    return taken


def command_timings(backend: str, count: int) -> list[float]:
    with make_sandbox(backend, SandboxConfig()) as sandbox:
        sandbox.exec("cd /workspace")
        return timings(lambda: sandbox.exec("echo hello"), count)


def fresh_exec_timings(count: int) -> list[float]:
    """The baseline: `docker exec` of a new bash per command, as InterCode does."""
    from envs.sandbox.docker import DockerSandbox

    sandbox = DockerSandbox()
    try:
        container = sandbox.container
        return timings(lambda: container.exec_run(["bash", "-c", "echo hello"]), count)
    finally:
        sandbox.close()


def env_steps_per_second(backend: str, envs: int, steps: int) -> float:
    """Steps/s of `envs` terminal envs stepped in parallel threads (resets not counted)."""
    action = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}
        ],
    }
    pool = [TerminalEnv(sandbox=backend, max_turns=steps + 1) for _ in range(envs)]
    for index, env in enumerate(pool):
        env.reset(seed=index)
    barrier = threading.Barrier(envs + 1)

    def play(env: TerminalEnv) -> None:
        barrier.wait()
        for _ in range(steps):
            env.step(action)

    workers = [threading.Thread(target=play, args=(env,)) for env in pool]
    for worker in workers:
        worker.start()
    barrier.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    for env in pool:
        env.close()
    return envs * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--resets", type=int, default=20)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=25, help="steps per env")
    parser.add_argument("--backends", default="bwrap,docker")
    args = parser.parse_args()
    backends = args.backends.split(",")
    daemon = None
    if "docker" in backends:
        from envs.sandbox.dockerd import DockerDaemon, ensure_base_image

        try:
            daemon = DockerDaemon.ensure()
            ensure_base_image()
        except SandboxError as error:
            Console().print(f"docker skipped: {error}")
            backends.remove("docker")
    try:
        rows = measure(backends, args)
    finally:
        if daemon is not None:
            daemon.stop()
    Console(width=130).print(render(rows, args))


def measure(backends: list[str], args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    targets = {"bwrap": ("<= 50 ms", "<= 5 ms, >= 15x"), "docker": ("<= 500 ms", ">= 15x")}
    for backend in backends:
        reset_target, command_target = targets[backend]
        rows.append((f"{backend}: reset", reset_timings(backend, args.resets), "", reset_target))
        pooled = pooled_reset_timings(backend, args.resets)
        rows.append((f"{backend}: reset from a pool of 2 started spares", pooled, "", reset_target))
        rows.append(
            (
                f"{backend}: command in the persistent shell",
                command_timings(backend, args.commands),
                "",
                command_target,
            )
        )
    if "docker" in backends:
        baseline = fresh_exec_timings(max(20, args.commands // 4))
        rows.append(("docker: fresh `docker exec` per command (baseline)", baseline, "", ""))
    for backend in backends:
        rate = env_steps_per_second(backend, args.envs, args.steps)
        rows.append(
            (f"{backend}: Terminal-v0, {args.envs} envs in parallel", None, f"{rate:,.0f}", "")
        )
    return rows


def render(rows: list[Row], args: argparse.Namespace) -> Table:
    table = Table(title=f"sandbox latency ({args.commands} commands, {args.resets} resets)")
    for column in ("case", "p50 ms", "p99 ms", "ratio", "steps/s", "target"):
        table.add_column(column, justify="left" if column == "case" else "right")
    baseline = next((r[1] for r in rows if "baseline" in r[0]), None)
    base_p50 = statistics.median(baseline) if baseline else None
    for case, values, rate, target in rows:
        if values is None:
            table.add_row(case, "", "", "", rate, target)
            continue
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        is_command = "command" in case
        ratio = f"{base_p50 / p50:.1f}x" if base_p50 and is_command else ""
        table.add_row(case, f"{p50 * 1000:.2f}", f"{p99 * 1000:.2f}", ratio, rate, target)
    return table


if __name__ == "__main__":
    main()
