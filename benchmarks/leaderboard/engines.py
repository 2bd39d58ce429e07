"""How each kind of policy reaches the agent loop: always as an `Engine`, so that scripted
baselines, local models, adapters and remote endpoints all play through the very loop
training uses (`agents.rollout.run_episode`) and are stored and measured the same way.

- `ScriptedEngine`: a scripted agent (do-nothing, oracle) behind the engine interface;
- `EpisodeView`: one episode's view of a shared engine: which adapter it asks for, and the
  tokens it used (from the engine's `usage`, so endpoints without token ids count too);
- `Engines`: the engines a benchmark opens, one per (backend, base model), shared by every
  policy on that model; adapters are swapped in one after another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

from agents.compose import build_engine, serve_policy
from agents.config import EngineConfig, ModelConfig, ServeSection
from agents.engines.aio import WholeReplies
from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    Engine,
    Message,
    SamplingParams,
    ToolSchema,
)
from benchmarks.leaderboard.policies import PolicySpec
from envs.core import ScriptedAgent

logger = logging.getLogger(__name__)


class EpisodeRecorder(gym.Wrapper[Any, Any, Any, Any]):
    """Keeps every info and reward of the episode, for the task set's scorer and for
    scripted agents (which read `info` as `envs.core.run_episode` gives it to them)."""

    def __init__(self, env: gym.Env[Any, Any]):
        super().__init__(env)
        self.infos: list[dict[str, Any]] = []
        self.rewards: list[float] = []
        self.info: dict[str, Any] = {}
        self.terminated = self.truncated = False

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        observation, info = self.env.reset(**kwargs)
        self.infos, self.rewards, self.info = [info], [], dict(info)
        self.terminated = self.truncated = False
        return observation, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        self.infos.append(info)
        self.rewards.append(float(reward))
        self.info = self.info | info
        self.terminated, self.truncated = terminated, truncated
        return observation, reward, terminated, truncated, info


class _Unsupported(WholeReplies):
    """The engine methods a policy view does not serve; it streams its whole reply at once
    (subclasses define `generate`; the async ones run it on threads)."""

    def encode(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None) -> Any:
        raise NotImplementedError("benchmark engines only generate")

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: Any = BASE,
        images: Sequence[bytes] = (),
    ) -> Any:
        raise NotImplementedError("benchmark engines only generate")

    def load_adapter(self, path: str, version: int) -> None:
        raise NotImplementedError("benchmark engines only generate")

    def prepare_adapter(self, path: str) -> None:
        raise NotImplementedError("benchmark engines only generate")

    def close(self) -> None:
        self._close_threads()


class ScriptedEngine(_Unsupported):
    """A scripted agent as an engine: `generate` returns its action as the assistant message.

    The agent is built on the first request, after the env's reset, because reference
    agents read the episode's task from the env.
    """

    def __init__(self, build: Callable[[], ScriptedAgent], recorder: EpisodeRecorder):
        self._build, self._recorder = build, recorder
        self._agent: ScriptedAgent | None = None
        self.prompt_tokens = self.completion_tokens = 0

    @property
    def policy_version(self) -> int:
        return 0

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        if self._agent is None:
            self._agent = self._build()
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        observation = [dict(m) for m in messages[last + 1 :]]
        action = self._agent.act(observation, dict(self._recorder.info))
        message = {"role": "assistant", "content": action} if isinstance(action, str) else action
        reason = "tool_calls" if message.get("tool_calls") else "stop"
        return Completion(dict(message), (), (), (), reason, 0)


class EpisodeView(_Unsupported):
    """One episode's handle on a shared engine (see the module docstring)."""

    def __init__(self, engine: Engine, adapter: str | None):
        self.engine, self.adapter = engine, adapter
        self.prompt_tokens = self.completion_tokens = 0

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version if self.adapter == POLICY else 0

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        completion = self.engine.generate(messages, tools, sampling, self.adapter)
        usage = completion.usage or {}
        self.prompt_tokens += int(usage.get("prompt_tokens", len(completion.prompt_token_ids)))
        self.completion_tokens += int(
            usage.get("completion_tokens", len(completion.completion_token_ids))
        )
        return completion


class Engines:
    """Opens engines on demand and closes them all at the end (a context manager).

    Args:
        engine: the engine config of model policies (`agents.compose.build_engine` builds
            each, with the policy's own backend).
        serve: "direct" hands episodes the engine itself, as the training rollouts do;
            "proxy" serves it behind the token-exact proxy (`agents.serving.server.in_thread`) and
            episodes talk HTTP to it, as live clients do.
        proxy_store: where the proxy records its turns (serve="proxy").
        api_key: bearer token of OpenAI-compatible endpoints.
    """

    def __init__(
        self,
        engine: EngineConfig | None = None,
        serve: str = "direct",
        proxy_store: str | None = None,
        api_key: str | None = None,
    ):
        self.engine = engine or EngineConfig()
        self.serve, self.proxy_store, self.api_key = serve, proxy_store, api_key
        self._open: dict[tuple[str, str], Engine] = {}
        self._urls: dict[tuple[str, str], str] = {}
        self._versions: dict[tuple[str, str], int] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def prepare(self, spec: PolicySpec) -> Callable[[], EpisodeView]:
        """Makes the engine serve `spec` and returns a factory of per-episode views."""
        if spec.kind == "endpoint":
            assert spec.base_url is not None  # parse_policy requires it
            engine = self._remote(spec.base_url, spec.name, api_key=self.api_key)
            return lambda: EpisodeView(engine, POLICY)
        key = (spec.engine, spec.name)
        shared = self._engine(key)
        adapter = BASE
        if spec.kind == "adapter":
            assert spec.adapter_dir is not None
            # Versions must increase whatever the order of steps asked for.
            self._versions[key] = self._versions.get(key, 0) + 1
            shared.load_adapter(spec.adapter_dir, self._versions[key])
            adapter = POLICY
        if self.serve == "proxy":
            return self._through_proxy(key, adapter)
        return lambda: EpisodeView(shared, adapter)

    def _engine(self, key: tuple[str, str]) -> Engine:
        if key not in self._open:
            backend, model = key
            logger.info("starting the %s engine for %s", backend, model)
            config = dataclasses.replace(self.engine, backend=backend)
            engine = build_engine(config, ModelConfig(model))
            self._stack.callback(engine.close)
            self._open[key] = engine
        return self._open[key]

    def _remote(
        self, base_url: str, model: str, api_key: str | None = None, token_ids: bool = False
    ) -> Engine:
        """A client of an OpenAI-compatible endpoint, closed with the others."""
        config = EngineConfig(
            backend="remote", base_url=base_url, api_key=api_key, token_ids=token_ids
        )
        engine = build_engine(config, ModelConfig(model))
        self._stack.callback(engine.close)
        return engine

    def _through_proxy(
        self, key: tuple[str, str], adapter: str | None
    ) -> Callable[[], EpisodeView]:
        from agents.store import Store

        if key not in self._urls:
            if self.proxy_store is None:
                raise ValueError("serve=proxy needs a proxy store path")
            store = Store(self.proxy_store)
            self._stack.callback(store.close)
            served = serve_policy(
                self._open[key],
                store,
                ServeSection(port=0),
                ModelConfig(key[1]),
                env_id="benchmark",
            )
            url, _ = self._stack.enter_context(served)
            self._urls[key] = url
        # The proxy serves `policy` (the adapter) and `base` (switched off) by name.
        model = "policy" if adapter == POLICY else "base"
        client = self._remote(self._urls[key], model, token_ids=True)
        return lambda: EpisodeView(client, POLICY)
