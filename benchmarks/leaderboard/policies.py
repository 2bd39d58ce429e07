"""Policies a leaderboard compares, from one-line specs:

    do-nothing                      the do-nothing baseline (`envs.core.IdleAgent`)
    oracle                          the task set's reference agent (where it has one)
    tiny | smollm2-135m | DIR       a base model on the default engine (embedded)
    vllm:smollm2-135m               a base model on a named engine (embedded | vllm)
    adapter:RUN_DIR@3               the LoRA adapter a training run published at step 3
    adapter:RUN_DIR@latest | @all   its newest adapter | every step (a learning curve,
                                    the base model as step 0)
    openai:MODEL@URL                any OpenAI-compatible endpoint, e.g.
                                    openai:gpt-4o-mini@https://api.openai.com/v1

A spec becomes a `PolicySpec` (validated, frozen); `weights_hash` fingerprints what the
policy runs: model and adapter files, or for a scripted agent its source code.
"""

from __future__ import annotations

import hashlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agents import models

Kind = Literal["scripted", "model", "adapter", "endpoint"]
ENGINES = ("embedded", "vllm")
SCRIPTED = {"do-nothing": "do-nothing", "idle": "do-nothing", "oracle": "oracle"}
SCRIPTED["reference"] = "oracle"
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf", "*.pt")


@dataclass(frozen=True)
class PolicySpec:
    """One policy to evaluate."""

    label: str
    """How the leaderboard names it."""
    kind: Kind
    name: str
    """scripted: do-nothing | oracle; model / adapter: the base model; endpoint: the model."""
    engine: str = "embedded"
    adapter_dir: str | None = None
    step: int | None = None
    """The training step of an adapter (0: the base model of a learning curve)."""
    series: str | None = None
    """The learning curve it belongs to: the run directory of an adapter."""
    base_url: str | None = None


def parse_policy(text: str, engine: str = "embedded") -> list[PolicySpec]:
    """Specs of one policy string (see the module docstring); `@all` gives several."""
    text = text.strip()
    if not text:
        raise ValueError("an empty policy spec; try policy=tiny or policy=[oracle,tiny]")
    if text in SCRIPTED:
        return [PolicySpec(SCRIPTED[text], "scripted", SCRIPTED[text])]
    prefix, sep, rest = text.partition(":")
    if sep and prefix == "adapter":
        return _adapter_specs(rest, engine)
    if sep and prefix == "openai":
        model, at, url = rest.partition("@")
        if not (model and at and re.match(r"https?://", url)):
            raise ValueError(f"{text!r}: write openai:MODEL@http://HOST:PORT/v1")
        return [PolicySpec(text, "endpoint", model, engine="remote", base_url=url)]
    if sep and prefix in ENGINES:
        return [PolicySpec(text, "model", rest, engine=prefix)]
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {', '.join(ENGINES)}")
    return [PolicySpec(text, "model", text, engine=engine)]


def _adapter_specs(rest: str, engine: str) -> list[PolicySpec]:
    run, _, which = rest.rpartition("@") if "@" in rest else (rest, "", "latest")
    run_dir = Path(run)
    steps = adapter_steps(run_dir)
    if not steps:
        raise ValueError(f"no adapters under {run_dir}/adapters (v1, v2, ...): is it a run dir?")
    base = base_model(run_dir)
    series = run_dir.name
    if which == "all":
        chosen = [0, *steps]
    elif which == "latest":
        chosen = [steps[-1]]
    elif which.isdigit() and int(which) in steps + [0]:
        chosen = [int(which)]
    else:
        raise ValueError(f"adapter:{rest}: step {which!r} not in {steps}; or use @latest, @all")
    return [
        PolicySpec(f"{series}@{step}", "model", base, engine=engine, step=0, series=series)
        if step == 0
        else PolicySpec(
            f"{series}@{step}",
            "adapter",
            base,
            engine=engine,
            adapter_dir=str(run_dir / "adapters" / f"v{step}"),
            step=step,
            series=series,
        )
        for step in chosen
    ]


def adapter_steps(run_dir: Path) -> list[int]:
    """The steps a run published adapters at (`adapters/v<step>`), ascending."""
    found = [p.name[1:] for p in (run_dir / "adapters").glob("v*") if p.is_dir()]
    return sorted(int(s) for s in found if s.isdigit())


def base_model(run_dir: Path) -> str:
    """The base model of a training run, from the resolved config it wrote."""
    from omegaconf import OmegaConf

    config = run_dir / "config.yaml"
    if not config.exists():
        raise ValueError(f"{config} is missing: adapter policies need a trainers.run directory")
    return str(OmegaConf.load(config).model.name)


def weights_hash(spec: PolicySpec, oracle_source: Any = None) -> str:
    """sha256 (first 16 hex digits) of what decides the policy's actions."""
    digest = hashlib.sha256()
    if spec.kind == "scripted":
        # A scripted policy's "weights" are its code.
        from envs.core import IdleAgent

        target = IdleAgent if spec.name == "do-nothing" else oracle_source
        digest.update(inspect.getsource(target).encode() if target is not None else b"none")
    elif spec.kind == "endpoint":
        # A remote model's weights cannot be read: the name and URL are all there is.
        digest.update(f"{spec.name}@{spec.base_url}".encode())
        return "remote:" + digest.hexdigest()[:16]
    else:
        _hash_files(digest, models.resolve(spec.name))
        if spec.adapter_dir is not None:
            _hash_files(digest, Path(spec.adapter_dir))
    return digest.hexdigest()[:16]


def _hash_files(digest: hashlib._Hash, directory: Path) -> None:
    files = sorted({p for pattern in _WEIGHT_FILES for p in directory.glob(pattern)})
    if not files:
        raise ValueError(f"no weight files ({', '.join(_WEIGHT_FILES)}) in {directory}")
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
