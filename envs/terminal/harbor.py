"""Harbor task folders (terminal-bench 2.0's format) for the terminal env: loading, the
local image build, and the converter from the terminal-bench 1 layout.

A Harbor task is a folder holding `instruction.md` (what the agent is asked), `task.toml`
(`[metadata]`, `[agent] timeout_sec`, `[verifier] timeout_sec`, `[environment]`
`build_timeout_sec` and resources), `environment/Dockerfile` (the image the agent works
in), `tests/test.sh` (the verifier: it writes the reward to `/logs/verifier/reward.txt`, a
single number, or `/logs/verifier/reward.json`, an object of named numbers) and
`solution/solve.sh` (the reference solution). `task.toml` is read with the standard
library's `tomllib`: the `harbor` package itself is not on this machine's registry.

A task folder is untrusted input: its files go into the sandbox, the verifier's output and
the stored transcripts. A symbolic link in it may point only inside the folder (resolved
through every link of a chain); a task with a link that leaves it, or that is itself a
link, is refused with a ValueError naming the link, so a task cannot bring in a file of the
host (`tasks.check_links`, which terminal-bench folders and so the converter get too). The
folder is checked again right before a Docker build context is made of it, and each file as
it is read into the context: a folder can change between loading and building. Every number
read from `task.toml` (the agent's, the verifier's and the build's `timeout_sec` /
`build_timeout_sec`) must be a finite number of seconds above 0 and at most
`MAX_TIMEOUT_SEC` (a day; `tasks.seconds`).

How the Dockerfile is used:
- Docker backend: built locally with `--network none` and never pulled; the only allowed
  `FROM` is the sandbox base image (`clawgym/sandbox-base`, with no tag or with the tag of
  the image built by scripts/docker_base_image.sh).
- bubblewrap backend: there is no image, so its instructions become a setup script run in
  the sandbox before the agent starts: `RUN` runs, `WORKDIR` is made and becomes the
  shell's directory, `ENV` sets the task's environment, `COPY` / `ADD` of files of
  `environment/` write them. What it cannot do: anything a `RUN` writes outside the work
  directory, `/logs` and `/tmp` fails (the host's `/usr` and `/etc` are read-only), packages
  the host lacks are missing, and `USER`, `ARG`, `VOLUME`, `SHELL`, `ONBUILD`, multi-stage
  `COPY --from` and remote `ADD` are refused with an error naming them.

Not used from `task.toml`: `cpus`, `memory_mb`, `storage_mb` and `allow_internet` (the
env's own sandbox limits hold, and there is never a network), `[verifier.env]` and
`[solution.env]`. Only `solution/solve.sh` is the reference solution; other files of
`solution/` are not copied.

The shipped tasks are kept once, in terminal-bench form (`envs/terminal/tasks/`); `tasks=harbor`
converts them on first use into the cache (`shipped_harbor`). Convert any terminal-bench
task folders into Harbor ones (no arguments: the shipped tasks into the cache, its path
logged):

    python -m envs.terminal.harbor [SOURCE_DIR TARGET_DIR]
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import logging
import os
import re
import shlex
import shutil
import sys
import tarfile
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from envs.terminal.tasks import (
    SHIPPED,
    TerminalTask,
    check_links,
    load_tbench_task,
    seconds,
)

logger = logging.getLogger(__name__)

BASE_REPOSITORY = "clawgym/sandbox-base"
REWARD_DIR = "/logs/verifier"
TEST_COMMAND = "bash /tests/test.sh"
# The agent's commands are cut at this many seconds unless `[agent] timeout_sec` is shorter
# (Harbor's agent timeout bounds a whole episode; the env bounds each command).
COMMAND_TIMEOUT = 30.0
_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL"}


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and the rest of the line."""

    keyword: str
    argument: str


def base_image_tag() -> str:
    """The local sandbox base image, the only image a Harbor Dockerfile may start FROM."""
    from envs.sandbox.docker import base_image_tag as tag

    return tag()


def parse_dockerfile(text: str, where: str) -> list[Instruction]:
    """The instructions of a Dockerfile (continuations joined, comments dropped); raises
    ValueError unless the first is `FROM` the local base image."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not _comment(ln)))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, argument = line.strip().partition(" ")
            instructions.append(Instruction(keyword.upper(), argument.strip()))
    if not instructions or instructions[0].keyword != "FROM":
        raise ValueError(f"{where} does not start with FROM")
    check_base(instructions[0].argument, where)
    if any(i.keyword == "FROM" for i in instructions[1:]):
        raise ValueError(f"{where} has several FROM lines; multi-stage builds are not supported")
    return instructions


def _comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def check_base(argument: str, where: str) -> None:
    """Raises ValueError unless `FROM argument` names the local base image."""
    words = [w for w in argument.split() if not w.startswith("--")]  # --platform=...
    image = words[0] if words else ""
    repository, _, tag = image.partition(":")
    if repository != BASE_REPOSITORY or tag not in ("", base_image_tag().partition(":")[2]):
        raise ValueError(
            f"{where}: FROM {argument} is not allowed: images are never pulled here; start from "
            f"the local sandbox base image, FROM {BASE_REPOSITORY} (built as {base_image_tag()} "
            "by scripts/docker_base_image.sh)"
        )


# -- loading --------------------------------------------------------------------------------
@functools.cache
def load_harbor(directory: str) -> tuple[TerminalTask, ...]:
    """Every Harbor task folder (one holding `task.toml`) under `directory`, sorted by name."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"Harbor task set {directory!r} is not a directory")
    tasks = [load_harbor_task(path.parent) for path in sorted(root.glob("*/task.toml"))]
    if not tasks:
        raise ValueError(f"no Harbor task folders (with a task.toml) in {directory}")
    return tuple(tasks)


def load_harbor_task(path: Path) -> TerminalTask:
    """One Harbor task folder; raises ValueError naming what is missing or malformed, or a
    link that leaves the folder (see the module docstring)."""
    check_links(path, "Harbor task")
    for required in ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh"):
        if not (path / required).is_file():
            raise ValueError(f"Harbor task {path} has no {required}")
    if not (path / "solution" / "solve.sh").is_file():
        raise ValueError(f"Harbor task {path} has no solution/solve.sh (the reference solution)")
    try:
        config = tomllib.loads((path / "task.toml").read_text())
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path / 'task.toml'} is not valid TOML: {error}") from None
    instruction = (path / "instruction.md").read_text().strip()
    if not instruction:
        raise ValueError(f"{path / 'instruction.md'} is empty")
    dockerfile = path / "environment" / "Dockerfile"
    instructions = parse_dockerfile(dockerfile.read_text(), str(dockerfile))
    workdir = _workdir(instructions)
    agent_timeout = _seconds(config, "agent", 600.0, path)
    _seconds(config, "environment", 600.0, path, key="build_timeout_sec")  # read by build_image
    return TerminalTask(
        task_id=f"harbor/{path.name}",
        kind="harbor",
        instruction=instruction,
        setup=setup_script(instructions, path / "environment"),
        solution=(path / "solution" / "solve.sh").read_text(),
        workdir=workdir,
        writable=(workdir, "/logs"),
        tests=_files(path / "tests"),
        test_command=TEST_COMMAND,
        test_timeout=_seconds(config, "verifier", 600.0, path),
        command_timeout=min(agent_timeout, COMMAND_TIMEOUT),
        env=_environment(instructions),
        environment=str(path / "environment"),
    )


def _seconds(
    config: dict[str, Any], section: str, default: float, path: Path, key: str = "timeout_sec"
) -> float:
    """`[section] key` of a task's `task.toml`: a finite number of seconds in (0,
    MAX_TIMEOUT_SEC], else a ValueError naming the field, its value and the bound."""
    return seconds(
        config.get(section, {}).get(key, default), f"{path / 'task.toml'}: [{section}] {key}"
    )


def _files(directory: Path) -> tuple[tuple[str, str], ...]:
    return tuple(
        (str(file.relative_to(directory)), file.read_text())
        for file in sorted(directory.rglob("*"))
        if file.is_file() and "__pycache__" not in file.parts
    )


def _workdir(instructions: list[Instruction]) -> str:
    workdirs = [i.argument for i in instructions if i.keyword == "WORKDIR"]
    return workdirs[-1] if workdirs else "/app"


def _environment(instructions: list[Instruction]) -> tuple[tuple[str, str], ...]:
    found: dict[str, str] = {}
    for instruction in (i for i in instructions if i.keyword == "ENV"):
        words = shlex.split(instruction.argument)
        if words and "=" not in words[0]:
            found[words[0]] = " ".join(words[1:])
        else:
            for word in (w for w in words if "=" in w):
                key, _, value = word.partition("=")
                found[key] = value
    return tuple(found.items())


def setup_script(instructions: list[Instruction], context: Path) -> str:
    """The bash that stands in for the image build under bubblewrap; instructions it cannot
    perform become a line that fails with their name (see `bwrap_problems`)."""
    lines = ["set -e"]
    for instruction in instructions[1:]:
        keyword, argument = instruction.keyword, instruction.argument
        if keyword == "RUN":
            lines.append(_run_command(argument))
        elif keyword == "WORKDIR":
            lines.append(f"mkdir -p {shlex.quote(argument)} && cd {shlex.quote(argument)}")
        elif keyword == "ENV":
            lines.extend(f"export {k}={shlex.quote(v)}" for k, v in _environment([instruction]))
        elif keyword in ("COPY", "ADD"):
            lines.extend(_copy(argument, context))
        elif keyword not in _IGNORED:
            lines.append(f"# unsupported under bwrap: {keyword} {argument}")
    return "\n".join(lines) + "\n"


def bwrap_problems(task: TerminalTask) -> list[str]:
    """The Dockerfile instructions of a Harbor task that bubblewrap cannot perform."""
    return re.findall(r"^# unsupported under bwrap: (.*)$", task.setup, re.MULTILINE)


def _run_command(argument: str) -> str:
    if argument.startswith("["):
        return shlex.join(json.loads(argument))
    return f"( {argument} )"


def _copy(argument: str, context: Path) -> list[str]:
    words = shlex.split(argument)
    if any(w.startswith("--") for w in words) or len(words) < 2:
        return [f"# unsupported under bwrap: COPY {argument}"]
    *sources, target = words
    lines = []
    for source in sources:
        origin = (context / source).resolve()
        if "://" in source or not origin.is_relative_to(context.resolve()) or not origin.exists():
            return [f"# unsupported under bwrap: COPY {argument}"]
        files = (
            [origin] if origin.is_file() else sorted(p for p in origin.rglob("*") if p.is_file())
        )
        for file in files:
            if origin.is_file():
                inside = target + origin.name if target.endswith("/") else target
            else:
                inside = f"{target.rstrip('/')}/{file.relative_to(origin)}"
            data = base64.b64encode(file.read_bytes()).decode()
            quoted = shlex.quote(inside)
            lines.append(f"mkdir -p $(dirname {quoted}) && echo {data} | base64 -d > {quoted}")
            if file.stat().st_mode & 0o111:
                lines.append(f"chmod +x {quoted}")
    return lines


def for_backend(task: TerminalTask, backend: str) -> TerminalTask:
    """A Harbor task as `backend` runs it: under Docker the built image holds its setup (no
    setup script runs); under bubblewrap, a ValueError names what bubblewrap cannot do."""
    if task.kind != "harbor":
        return task
    if backend == "docker":
        return replace(task, setup="")
    problems = bwrap_problems(task)
    if problems:
        raise ValueError(
            f"{task.task_id} cannot run under bwrap: its Dockerfile needs {'; '.join(problems)}; "
            "use sandbox=docker"
        )
    return task


# -- Docker image ---------------------------------------------------------------------------
@functools.cache
def build_image(environment: str) -> str:
    """Builds a Harbor task's `environment/` into a local image (FROM the base image, never
    pulled, no network during RUN) once per content; returns its tag."""
    import docker
    from docker.errors import BuildError, DockerException, ImageNotFound

    from envs.sandbox import SandboxError

    context = Path(environment)
    # The folder was checked when loaded, and may have changed since: check it again right
    # before its files go to the Docker daemon (`_context_archive` checks each file read too).
    check_links(context.parent, "Harbor task")
    archive, digest = _context_archive(context)
    tag = f"clawgym/harbor-{_slug(context.parent.name)}:{digest}"
    config = tomllib.loads((context.parent / "task.toml").read_text())
    timeout = _seconds(config, "environment", 600.0, context.parent, key="build_timeout_sec")
    client = docker.from_env(timeout=int(timeout))
    try:
        client.images.get(tag)
        return tag
    except ImageNotFound:
        pass
    logger.info("building %s from %s", tag, context)
    try:
        client.images.build(
            fileobj=archive,
            custom_context=True,
            tag=tag,
            pull=False,
            network_mode="none",
            rm=True,
            forcerm=True,
            labels={"clawgym.harbor": "1"},
        )
    except (BuildError, DockerException) as error:
        raise SandboxError(f"building the image of {context.parent.name} failed: {error}") from None
    finally:
        client.close()
    return tag


def _context_archive(context: Path) -> tuple[io.BytesIO, str]:
    """The build context as a tar, its Dockerfile's FROM pinned to the base image's tag."""
    dockerfile = (context / "Dockerfile").read_text()
    pinned = re.sub(
        rf"^(\s*FROM\s+){re.escape(BASE_REPOSITORY)}(:\S+)?",
        rf"\g<1>{base_image_tag()}",
        dockerfile,
        count=1,
        flags=re.MULTILINE | re.IGNORECASE,
    )
    digest = hashlib.sha256(pinned.encode())
    buffer = io.BytesIO()
    root = context.parent.resolve()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for file in sorted(p for p in context.rglob("*") if p.is_file()):
            name = str(file.relative_to(context))
            if not file.resolve().is_relative_to(root):  # a link made after the folder check
                raise ValueError(
                    f"Harbor task {context.parent}: environment/{name} leads out of the task "
                    "folder; links must stay inside it"
                )
            data = pinned.encode() if name == "Dockerfile" else file.read_bytes()
            digest.update(name.encode() + b"\0" + data)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), file.stat().st_mode & 0o777
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer, digest.hexdigest()[:12]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "task"


# -- converter from terminal-bench 1 ----------------------------------------------------------
_TEST_SH = """#!/bin/bash
# Harbor verifier: 1 in {reward}/reward.txt when every test passes, else 0.
mkdir -p {reward}
{command}
if [ $? -eq 0 ]; then echo 1 > {reward}/reward.txt; else echo 0 > {reward}/reward.txt; fi
"""


def convert_tbench_task(source: Path, target: Path) -> Path:
    """Writes the Harbor folder `target/<name>` of the terminal-bench task folder `source`:
    its setup.sh is copied into the image and run by the Dockerfile, its tests are run by
    tests/test.sh, which writes the reward; returns the new folder."""
    task = load_tbench_task(source)
    meta: dict[str, Any] = yaml.safe_load((source / "task.yaml").read_text()) or {}
    folder = target / source.name
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "environment").mkdir(parents=True)
    (folder / "solution").mkdir()
    (folder / "instruction.md").write_text(task.instruction + "\n")
    (folder / "task.toml").write_text(_task_toml(meta, task))
    lines = [f"FROM {BASE_REPOSITORY}", f"WORKDIR {task.workdir}"]
    if task.setup:
        (folder / "environment" / "setup.sh").write_text(task.setup)
        lines += ["COPY setup.sh /tmp/setup.sh", "RUN bash /tmp/setup.sh && rm /tmp/setup.sh"]
    (folder / "environment" / "Dockerfile").write_text("\n".join(lines) + "\n")
    for name, content in task.tests:
        (folder / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "tests" / name).write_text(content)
    test_sh = _TEST_SH.format(reward=REWARD_DIR, command=task.test_command)
    (folder / "tests" / "test.sh").write_text(test_sh)
    (folder / "solution" / "solve.sh").write_text(task.solution)
    return folder


def _task_toml(meta: dict[str, Any], task: TerminalTask) -> str:
    fields = {k: meta[k] for k in ("author_name", "difficulty", "category") if k in meta}
    lines = ['version = "1.0"', "", "[metadata]"]
    lines += [f"{key} = {json.dumps(str(value))}" for key, value in fields.items()]
    lines += ["", "[verifier]", f"timeout_sec = {task.test_timeout:.1f}", "", "[agent]"]
    agent = seconds(meta.get("max_agent_timeout_sec", 300), "max_agent_timeout_sec")
    lines += [f"timeout_sec = {agent:.1f}", ""]
    lines += ["[environment]", "build_timeout_sec = 600.0", "cpus = 1", "memory_mb = 1024"]
    return "\n".join(lines) + "\n"


def convert_tbench(source: Path, target: Path) -> list[Path]:
    """Converts every terminal-bench task folder under `source` into `target`."""
    return [convert_tbench_task(p.parent, target) for p in sorted(source.glob("*/task.yaml"))]


def shipped_harbor(source: Path = SHIPPED) -> Path:
    """The terminal-bench task folders under `source` (the shipped ones by default) as Harbor
    folders, converted once into `$CLAWGYM_HOME/harbor/<digest>` (default ~/.cache/clawgym):
    the digest covers the tasks' files and this converter, so an edited task or converter
    is converted anew, and the repository keeps one copy of each task. Written beside and
    moved into place, so concurrent runs never read a half-written set."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    files = (p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for file in sorted(files):
        digest.update(str(file.relative_to(source)).encode() + b"\0" + file.read_bytes())
    home = Path(os.environ.get("CLAWGYM_HOME") or Path.home() / ".cache" / "clawgym")
    target = home / "harbor" / digest.hexdigest()[:16]
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        convert_tbench(source, staging)
        try:
            staging.rename(target)
        except OSError:  # another process moved its conversion into place first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    """The converter's command line; a task folder it refuses (a link that leaves it, a
    timeout that is not finite and bounded) ends it with the reason and nothing written
    for that task."""
    logging.basicConfig(level=logging.INFO)
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1:
        raise SystemExit("usage: python -m envs.terminal.harbor [SOURCE_DIR TARGET_DIR]")
    try:
        if args:
            target = Path(args[1])
            folders = convert_tbench(Path(args[0]), target)
            logger.info("wrote %d Harbor task folders to %s", len(folders), target)
        else:
            logger.info("the shipped tasks as Harbor folders: %s", shipped_harbor())
    except ValueError as error:
        raise SystemExit(f"python -m envs.terminal.harbor: {error}") from None


if __name__ == "__main__":
    main()
