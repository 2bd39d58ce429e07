"""Several engines serving one policy (`ReplicaSet`): vLLM replicas behind the one proxy.

    replicas = ReplicaSet([VLLMEngine("tiny", cpus=[0]), VLLMEngine("tiny", cpus=[1])])
    replicas.for_session("a1b2").generate(messages)    # always the same replica for a1b2
    replicas.load_adapter("runs/x/adapters/v3", 3)     # every replica serves v3 after it

Routing: the proxy asks `for_session` for a session's engine, so every turn of a session
lands on one replica, where its prefix is cached: the live replica that ranks the session
highest (rendezvous hashing, stable across processes), so that when a replica is lost only
its own sessions move. A request with no session (the judge's votes, the teacher's `score`,
`encode`) takes the live replicas in turn.

Publishing: `load_adapter` loads the version on every live replica, one after the other;
each keeps its older version for the requests it has in flight (`VLLMEngine`'s two LoRA
slots), so no request fails and each completion's `policy_version` is the version that
sampled it. Until the last replica has it, `policy_version` (the lowest) says the older one.

A replica that dies (`EngineDied`) is taken out of the rotation; a request that found it
dead before answering anything is sent again to the next replica (nothing of it was stored:
the proxy stores a turn once it is answered), one that was streaming when it died fails
cleanly. Where the set has a `replace` function, a new replica is started in the background,
given the newest adapter, and put back in the rotation.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import TypeVar

from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    Engine,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
)
from agents.engines.vllm_server import EngineDied

logger = logging.getLogger(__name__)
T = TypeVar("T")


def rank(session_id: str, replica: int) -> int:
    """How highly `replica` ranks for `session_id` (rendezvous hashing): the same in every
    process and run, unlike Python's `hash`. A cryptographic digest, not crc32: crc32 is
    linear, so keys that differ in the replica's digit alone rank in a correlated order
    (one replica of three won none of 64 sessions)."""
    digest = hashlib.blake2b(f"{session_id}:{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def replica_of(session_id: str, live: Sequence[int]) -> int:
    """The replica, among the `live` ones, that a session's requests go to."""
    return max(live, key=lambda replica: rank(session_id, replica))


class ReplicaSet:
    """Engines serving the same base model and adapters; see the module docstring.

    Args:
        engines: the replicas (at least one); closed with the set.
        replace: makes a new replica in the place of the one at an index that died (None:
            a dead replica stays out).
    """

    def __init__(self, engines: Sequence[Engine], replace: Callable[[int], Engine] | None = None):
        if not engines:
            raise ValueError("a replica set needs at least one engine")
        self.engines = list(engines)
        self.replace = replace
        self.live = list(range(len(self.engines)))
        self.replaced = 0
        """Replicas started in the place of dead ones so far."""
        self._turns = itertools.count()
        self._lock = threading.Lock()
        self._adapter: tuple[str, int] | None = None
        """The newest adapter published (path, version), which a new replica loads."""
        self._closed = False

    @property
    def policy_version(self) -> int:
        return min(self.engines[index].policy_version for index in self._live())

    def for_session(self, session_id: str) -> SessionEngine:
        """The engine every request of `session_id` goes to (its replica, while alive)."""
        return SessionEngine(self, session_id)

    # -- routing and losing replicas -----------------------------------------------------
    def _live(self) -> list[int]:
        with self._lock:
            if not self.live:
                raise EngineDied("every replica of the policy's server has died")
            return list(self.live)

    def _pick(self, session_id: str | None) -> int:
        live = self._live()
        if session_id is None:
            return live[next(self._turns) % len(live)]
        return replica_of(session_id, live)

    def _lost(self, index: int, error: EngineDied) -> None:
        """Takes a dead replica out of the rotation and, with `replace`, starts another."""
        with self._lock:
            if index not in self.live or self._closed:
                return
            self.live.remove(index)
        logger.error("replica %d of the policy's server died: %s", index, error)
        if self.replace is not None:
            threading.Thread(target=self._replace, args=(index,), daemon=True).start()

    def _replace(self, index: int) -> None:
        assert self.replace is not None
        try:
            engine = self.replace(index)
            with self._lock:
                adapter = self._adapter
            if adapter is not None:
                engine.load_adapter(*adapter)
        except Exception:
            logger.exception("replica %d could not be replaced", index)
            return
        with self._lock:
            dead, self.engines[index] = self.engines[index], engine
            if self._closed:
                engine.close()
                return
            self.live = sorted({*self.live, index})
            self.replaced += 1
        logger.info("replica %d replaced", index)
        try:
            dead.close()
        except Exception as error:  # it died: what is left of it is freed as it can be
            logger.debug("closing dead replica %d: %s", index, error)

    def _call(self, session_id: str | None, call: Callable[[Engine], T]) -> T:
        """`call` on the request's replica; again on another if that one is dead."""
        while True:
            index = self._pick(session_id)
            try:
                return call(self.engines[index])
            except EngineDied as died:
                self._lost(index, died)

    async def _agenerate(
        self,
        session_id: str | None,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None,
        sampling: SamplingParams | None,
        adapter: str | None,
    ) -> Completion:
        while True:
            index = self._pick(session_id)
            try:
                return await self.engines[index].agenerate(messages, tools, sampling, adapter)
            except EngineDied as died:
                self._lost(index, died)

    async def _astream(
        self,
        session_id: str | None,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None,
        sampling: SamplingParams | None,
        adapter: str | None,
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        while True:
            index = self._pick(session_id)
            stream = self.engines[index].astream(messages, tools, sampling, adapter)
            try:
                first = await anext(stream)
            except EngineDied as died:
                self._lost(index, died)
                continue
            except StopAsyncIteration:
                return
            break
        yield first
        try:
            async for item in stream:
                yield item
        except EngineDied as died:  # mid-stream: the client saw tokens, it fails cleanly
            self._lost(index, died)
            raise

    # -- the engine interface (requests without a session) -------------------------------
    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        return self._call(None, lambda engine: engine.generate(messages, tools, sampling, adapter))

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        return self.engines[self._pick(None)].stream(messages, tools, sampling, adapter)

    async def agenerate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        return await self._agenerate(None, messages, tools, sampling, adapter)

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        return self._astream(None, messages, tools, sampling, adapter)

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        return self._call(None, lambda engine: engine.encode(messages, tools))

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: str | None = BASE,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        return self._call(
            None, lambda engine: engine.score(prompt_ids, completion_ids, adapter, images)
        )

    def load_adapter(self, path: str, version: int) -> None:
        with self._lock:
            self._adapter = (path, version)
        for index in self._live():
            try:
                self.engines[index].load_adapter(path, version)
            except EngineDied as died:  # its replacement loads the newest adapter
                self._lost(index, died)

    def prepare_adapter(self, path: str) -> None:
        for index in self._live():
            self.engines[index].prepare_adapter(path)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engines = list(self.engines)
        errors = []
        for engine in engines:
            try:
                engine.close()
            except Exception as error:  # close the others first; the first error is raised
                errors.append(error)
        if errors:
            raise errors[0]


class SessionEngine:
    """The engine one session's requests use: its replica of a `ReplicaSet`, with the
    set's failover (`ReplicaSet._agenerate`, `_astream`)."""

    def __init__(self, replicas: ReplicaSet, session_id: str):
        self.replicas, self.session_id = replicas, session_id

    @property
    def policy_version(self) -> int:
        return self.replicas.policy_version

    def replica(self) -> Engine:
        """The replica this session's requests go to now."""
        return self.replicas.engines[self.replicas._pick(self.session_id)]

    async def agenerate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        return await self.replicas._agenerate(self.session_id, messages, tools, sampling, adapter)

    def astream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> AsyncGenerator[TokenChunk | Completion, None]:
        return self.replicas._astream(self.session_id, messages, tools, sampling, adapter)
