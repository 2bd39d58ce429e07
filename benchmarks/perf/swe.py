"""SWE env costs: workspace reset (copy-on-write from the project's image, with and without
a started spare, against a fresh copy of the tree into a base-image container; and bwrap's
copy), grading time per instance (gold patch, clean copy, F2P + P2P tests), and episodes per
hour with a real policy (smollm2-135m on the embedded engine) on this CPU.

    python -m benchmarks.perf.swe [--resets 10] [--grades 5] [--episodes 2] [--max-turns 3]
                                  [--backends bwrap,docker] [--model smollm2-135m]

Starts dockerd (as root) when none answers and stops it afterwards. Prints one table; the
reset `ratio` is the fresh copy's p50 over the row's p50, measured in the same run.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from envs.sandbox import Sandbox, SandboxConfig
from envs.swe.env import SWEEnv
from envs.swe.grading import grade, project_of
from envs.swe.instances import load_instances
from envs.swe.sources import TESTBED, Project, tree
from envs.swe.workspace import Workspaces, project_config, setup_command

logger = logging.getLogger(__name__)
Row = tuple[str, str, list[float], str]  # group, case, seconds per op, note


def fresh_copy(project: Project, fix_patch: str) -> Sandbox:
    """The baseline: a base-image container, the tree copied in, the same set-up steps."""
    from envs.sandbox.docker import DockerSandbox, base_image_tag

    sandbox = DockerSandbox(project_config(project, SandboxConfig()), image=base_image_tag())
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(tree(project), arcname=TESTBED.strip("/"))
    sandbox.container.put_archive("/", buffer.getvalue())
    result = sandbox.exec(setup_command(fix_patch), timeout=120)
    if result.exit_code != 0:
        raise RuntimeError(result.stdout + result.stderr)
    return sandbox


def reset_rows(backends: list[str], count: int) -> list[Row]:
    instance = load_instances()[0]
    project = project_of(instance.repo, instance.version)
    rows: list[Row] = []
    for backend in backends:
        plain = Workspaces(backend)
        plain.open(project, instance.patch).close()  # image built, caches warm
        name = "container from project image (CoW)" if backend == "docker" else "copy of tree"
        rows.append(
            ("reset", f"{backend}: {name}", reset(plain, project, instance.patch, count), "")
        )
        plain.close()
        if backend == "docker":
            pooled = Workspaces(backend, pool=1)
            pooled.open(project, instance.patch).close()
            time.sleep(3.0)  # the spare starts
            taken = reset(pooled, project, instance.patch, count, pause=2.0)
            rows.append(("reset", "docker: CoW + started spare (pool=1)", taken, ""))
            pooled.close()
            baseline = []
            for _ in range(count):
                started = time.perf_counter()
                sandbox = fresh_copy(project, instance.patch)
                baseline.append(time.perf_counter() - started)
                sandbox.close()
            rows.append(("reset", "docker: fresh copy into base container", baseline, "baseline"))
    return rows


def reset(
    workspaces: Workspaces, project: Project, patch: str, count: int, pause: float = 0.0
) -> list[float]:
    """Seconds of each `open` (closing is not counted, nor the pause a spare needs)."""
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        sandbox = workspaces.open(project, patch)
        taken.append(time.perf_counter() - started)
        sandbox.close()
        time.sleep(pause)
    return taken


def grading_rows(backends: list[str], count: int) -> list[Row]:
    instances = load_instances()
    chosen = instances[:: max(1, len(instances) // count)][:count]
    rows: list[Row] = []
    for backend in backends:
        workspaces = Workspaces(backend)
        taken, resolved = [], 0
        for instance in chosen:
            started = time.perf_counter()
            resolved += grade(workspaces, instance, instance.patch).resolved
            taken.append(time.perf_counter() - started)
        workspaces.close()
        note = f"gold resolved {resolved}/{len(chosen)}"
        rows.append(("grading", f"{backend}: gold patch, one instance", taken, note))
    return rows


def episode_rows(backend: str, model: str, episodes: int, max_turns: int) -> list[Row]:
    from agents.engines.base import SamplingParams
    from agents.engines.embedded import EmbeddedEngine
    from agents.rollout import run_episode
    from agents.seats import DirectSeat
    from agents.store import Store

    engine = EmbeddedEngine(model)
    env = SWEEnv(split="test", sandbox=backend, max_turns=max_turns)
    taken, turns, rewards = [], 0, []
    try:
        with tempfile.TemporaryDirectory() as folder:
            store = Store(Path(folder) / "store.sqlite")
            for index, task_id in enumerate(env.task_ids()[:episodes]):
                sampling = SamplingParams(temperature=0.6, max_tokens=96, seed=index)
                started = time.perf_counter()
                summary = run_episode(
                    env,
                    DirectSeat(engine, store),
                    env_id="clawgym/SWE-v0",
                    task_id=task_id,
                    sampling=sampling,
                )
                taken.append(time.perf_counter() - started)
                turns += summary.turns
                rewards.append(summary.total_reward)
            store.close()
    finally:
        env.close()
        engine.close()
    note = f"{3600 / statistics.mean(taken):.1f} episodes/h; {turns} turns; rewards {rewards}"
    return [("episodes", f"{backend}: {model}, {max_turns} turns", taken, note)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resets", type=int, default=10)
    parser.add_argument("--grades", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--backends", default="bwrap,docker")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    backends = args.backends.split(",")
    daemon = None
    if "docker" in backends:
        from envs.sandbox.dockerd import DockerDaemon, ensure_base_image

        daemon = DockerDaemon.ensure()
        ensure_base_image()
    try:
        rows = reset_rows(backends, args.resets) + grading_rows(backends, args.grades)
        if args.episodes:
            rows += episode_rows(backends[-1], args.model, args.episodes, args.max_turns)
    finally:
        if daemon is not None:
            daemon.stop()
    Console(width=160).print(render(rows))


def render(rows: list[Row]) -> Table:
    table = Table(title="SWE env (seconds per operation)")
    for column in ("what", "case", "p50 s", "mean s", "n", "ratio", "note"):
        table.add_column(column, justify="right" if column.endswith(("s", "n")) else "left")
    baseline = next((statistics.median(t) for g, _, t, n in rows if n == "baseline"), None)
    for group, case, taken, note in rows:
        p50 = statistics.median(taken)
        ratio = (
            f"{baseline / p50:.2f}x" if group == "reset" and baseline and "docker" in case else ""
        )
        table.add_row(
            group,
            case,
            f"{p50:.3f}",
            f"{statistics.mean(taken):.3f}",
            str(len(taken)),
            ratio,
            note,
        )
    return table


if __name__ == "__main__":
    main()
