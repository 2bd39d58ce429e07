"""The real projects SWE tasks are built from: pinned source archives (sdists, tests
included) of pure-Python libraries on PyPI, fetched by set-up and extracted to a cache.

    python -m envs.swe.sources            # fetch and extract every project (idempotent)

The cache is `$CLAWGYM_SWE_SOURCES`, by default `~/.cache/clawgym/swe`: `sdists/` holds the
archives as pip downloaded them (each checked against its pinned sha256), `trees/` the
extracted source trees that workspaces copy or bake into images. Each project's tests run
with Debian's python3 and pytest (the sandboxes' interpreter), offline, from the source tree
on `PYTHONPATH`: nothing is installed or built.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TESTBED = "/testbed"


@dataclass(frozen=True)
class Project:
    """One pinned project.

    Attributes:
        name: the PyPI name.
        version: the pinned version.
        sha256: digest of its sdist.
        repo: the upstream repository (SWE-bench's `repo` field).
        package: the code bugs are injected into, relative to the tree (a package directory
            or a single module).
        tests: pytest arguments that select its whole test suite.
        path: directories put on PYTHONPATH, relative to the tree.
    """

    name: str
    version: str
    sha256: str
    repo: str
    package: str
    tests: tuple[str, ...] = ("tests",)
    path: tuple[str, ...] = (".",)

    @property
    def key(self) -> str:
        """`<name>-<version>`: the tree's directory name and the image's tag stem."""
        return f"{self.name}-{self.version}"

    @property
    def pythonpath(self) -> str:
        """PYTHONPATH inside a workspace."""
        return ":".join(f"{TESTBED}/{p}".rstrip("/.") if p != "." else TESTBED for p in self.path)


PROJECTS: tuple[Project, ...] = (
    Project(
        "cachetools",
        "5.5.0",
        "2cc24fb4cbe39633fb7badd9db9ca6295d766d9c2995f245725a46715d050f2a",
        "tkem/cachetools",
        "src/cachetools",
        path=("src",),
    ),
    Project(
        "inflection",
        "0.5.1",
        "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
        "jpvanhal/inflection",
        "inflection",
        tests=("test_inflection.py",),
    ),
    Project(
        "isodate",
        "0.7.2",
        "4cd1aa0f43ca76f4a6c6c0292a85f40b35ec2e43e315b59f06e6d32171a953e6",
        "gweis/isodate",
        "src/isodate",
        path=("src",),
    ),
    Project(
        "jmespath",
        "1.0.1",
        "90261b206d6defd58fdd5e85f478bf633a2901798906be2ad389150c5c60edbe",
        "jmespath/jmespath.py",
        "jmespath",
    ),
    Project(
        "mistune",
        "3.0.2",
        "fc7f93ded930c92394ef2cb6f04a8aabab4117a91449e72dcc8dfa646a508be8",
        "lepture/mistune",
        "src/mistune",
        path=("src", "."),
    ),
    Project(
        "parse",
        "1.20.2",
        "b41d604d16503c79d81af5165155c0b20f6c8d6c559efa66b4b695c3e5a0a0ce",
        "r1chardj0n3s/parse",
        "parse.py",
    ),
    Project(
        "pathspec",
        "0.12.1",
        "a482d51503a1ab33b1c67a6c3813a26953dbdc71c31dacaef9a838c4e29f5712",
        "cpburnz/python-pathspec",
        "pathspec",
    ),
    Project(
        "sqlparse",
        "0.5.1",
        "bb6b4df465655ef332548e24f08e205afc81b9ab86cb1c45657a7ff173a3a00e",
        "andialbrecht/sqlparse",
        "sqlparse",
    ),
    Project(
        "xmltodict",
        "0.13.0",
        "341595a488e3e01a85a9d8911d8912fd922ede5fecc4dce437eb4b6c8d037e56",
        "martinblech/xmltodict",
        "xmltodict.py",
    ),
    Project(
        "tabulate",
        "0.9.0",
        "0095b12bf5966de529c0feb1fa08671671b3368eec77d7ef7ab114be2c068b3c",
        "astanin/python-tabulate",
        "tabulate",
        tests=("test",),
    ),
    Project(
        "webcolors",
        "24.8.0",
        "08b07af286a01bcd30d583a7acadf629583d1f79bfef27dd2c2c5c263817277d",
        "ubernostrum/webcolors",
        "src/webcolors",
        path=("src",),
    ),
    Project(
        "idna",
        "3.10",
        "12f65c9b470abda6dc35cf8e63cc574b1c52b11df2c86030af0ac09b01b13ea9",
        "kjd/idna",
        "idna",
    ),
    Project(
        "six",
        "1.16.0",
        "1e61c37477a1626458e36f7b1d82aa5c9b094fa4802892072e49de9c60c4c926",
        "benjaminp/six",
        "six.py",
        tests=("test_six.py",),
    ),
)
BY_REPO = {p.repo: p for p in PROJECTS}
BY_NAME = {p.name: p for p in PROJECTS}


def sources_dir() -> Path:
    """The cache of archives and trees (`$CLAWGYM_SWE_SOURCES` or ~/.cache/clawgym/swe)."""
    configured = os.environ.get("CLAWGYM_SWE_SOURCES")
    return Path(configured) if configured else Path.home() / ".cache" / "clawgym" / "swe"


def tree(project: Project) -> Path:
    """The extracted source tree of `project`; raises with the fix when it is not there."""
    path = sources_dir() / "trees" / project.key
    if not (path / ".clawgym-complete").exists():
        raise FileNotFoundError(
            f"the sources of {project.key} are not fetched; run `python -m envs.swe.sources`"
        )
    return path


def fetch(project: Project) -> Path:
    """Downloads (pip, sdist only) and extracts `project` unless it is already there."""
    target = sources_dir() / "trees" / project.key
    if (target / ".clawgym-complete").exists():
        return target
    archives = sources_dir() / "sdists"
    archives.mkdir(parents=True, exist_ok=True)
    archive = _archive(archives, project)
    if archive is None:
        # --no-binary for this one package only: its build backend may come as a wheel
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
            + ["--no-deps", "--no-binary", project.name, "-d", str(archives)]
            + [f"{project.name}=={project.version}"],
            check=True,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )
        archive = _archive(archives, project)
        if archive is None:
            raise FileNotFoundError(f"pip saved no sdist of {project.key} in {archives}")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != project.sha256:
        archive.unlink()
        raise ValueError(f"{archive.name}: sha256 {digest} is not the pinned {project.sha256}")
    _extract(archive, target)
    return target


def _archive(folder: Path, project: Project) -> Path | None:
    stems = {project.name, project.name.replace("-", "_"), project.name.capitalize()}
    for stem in stems:
        candidate = folder / f"{stem}-{project.version}.tar.gz"
        if candidate.exists():
            return candidate
    return None


def _extract(archive: Path, target: Path) -> None:
    """Extracts the archive's single top directory as `target` (atomically, by rename)."""
    staging = target.with_name(target.name + ".partial")
    subprocess.run(["rm", "-rf", str(staging), str(target)], check=True)
    staging.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")
    (top,) = list(staging.iterdir())
    top.rename(target)
    staging.rmdir()
    (target / ".clawgym-complete").write_text(f"extracted from {archive.name}\n")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = []
    for project in PROJECTS:
        try:
            logger.info("%s: %s", project.key, fetch(project))
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            logger.error("%s: %s", project.key, error)
            failed.append(project.key)
    if failed:
        raise SystemExit(f"could not fetch: {', '.join(failed)}")


if __name__ == "__main__":
    main()
