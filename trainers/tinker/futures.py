"""The Tinker server's futures: calls queued per owner and run on one worker thread, the
owners taking turns (round robin), so one client's burst delays another's call by at most
one call of each other owner, not by the whole burst.

A future's id is random (`secrets.token_urlsafe`) and answers only its owner; a queued
future can be cancelled; an owner may hold `max_queued` futures waiting (429 past it).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi.responses import JSONResponse, Response

from trainers.tinker.errors import NotFound, TooMany, UserError

logger = logging.getLogger(__name__)

POLL_SECONDS = 20.0
"""How long one retrieve_future waits before answering try_again."""
KEPT_FUTURES = 4096
"""Finished futures kept for (re)retrieval; older ones are forgotten."""

_Queued = tuple[Future, Callable[[], Any]]


class Futures:
    """Calls queued per owner on one worker thread, by request id."""

    def __init__(self, max_queued: int = 64):
        self.max_queued = max_queued
        self._lock = threading.Condition()
        self._queues: dict[str, deque[_Queued]] = {}
        self._turns: deque[str] = deque()
        """Owners with calls waiting, the next to run first."""
        self._futures: OrderedDict[str, tuple[str, Future]] = OrderedDict()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="tinker", daemon=True)
        self._worker.start()

    def submit(self, owner: str, call: Callable[[], Any]) -> str:
        """Queues `call` for `owner`; returns its request id.

        Raises:
            TooMany: `owner` already has `max_queued` calls waiting.
        """
        future = self._enqueue(owner, call)
        request_id = f"req-{secrets.token_urlsafe(18)}"
        with self._lock:
            self._futures[request_id] = (owner, future)
            while len(self._futures) > KEPT_FUTURES:
                oldest = next(iter(self._futures))
                if not self._futures[oldest][1].done():
                    break
                del self._futures[oldest]
        return request_id

    async def run(self, owner: str, call: Callable[[], Any]) -> Any:
        """`call` on the worker thread in `owner`'s turn, awaited here (for the REST routes,
        which answer at once rather than with a future)."""
        return await asyncio.wrap_future(self._enqueue(owner, call))

    def cancel(self, owner: str, request_id: Any) -> bool:
        """Cancels `owner`'s future if it has not started; returns whether it was cancelled.

        Raises:
            NotFound: no future of `owner`'s by that id.
        """
        future = self._owned(owner, request_id)
        with self._lock:
            cancelled = future.cancel()
            if cancelled:
                queue = self._queues.get(owner, deque())
                for item in [i for i in queue if i[0] is future]:
                    queue.remove(item)
                self._drop_if_empty(owner)
        return cancelled

    async def answer(self, owner: str, request_id: Any) -> Response:
        """The future's result, its error, or try_again after `POLL_SECONDS`."""
        future = self._owned(owner, request_id)
        try:
            result = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), POLL_SECONDS
            )
        except TimeoutError:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        except asyncio.CancelledError:
            if not future.cancelled():
                raise
            return JSONResponse({"error": "the request was cancelled", "category": "user"})
        except UserError as error:
            return JSONResponse({"error": str(error), "category": "user"})
        except Exception as error:
            logger.exception("request %s failed", request_id)
            return JSONResponse({"error": f"{type(error).__name__}: {error}", "category": "server"})
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return JSONResponse(result)

    def queued(self, owner: str) -> int:
        with self._lock:
            return len(self._queues.get(owner, ()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for queue in self._queues.values():
                for future, _ in queue:
                    future.cancel()
            self._queues.clear()
            self._turns.clear()
            self._lock.notify_all()

    def _owned(self, owner: str, request_id: Any) -> Future:
        entry = self._futures.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry[0] != owner:
            raise NotFound(f"unknown request_id {request_id!r}")
        return entry[1]

    def _enqueue(self, owner: str, call: Callable[[], Any]) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is closing")
            queue = self._queues.setdefault(owner, deque())
            if len(queue) >= self.max_queued:
                raise TooMany(
                    f"this key has {len(queue)} requests waiting, the limit "
                    "(tinker.limits.max_queued): wait for some to finish"
                )
            future: Future = Future()
            queue.append((future, call))
            if owner not in self._turns:
                self._turns.append(owner)
            self._lock.notify()
        return future

    def _drop_if_empty(self, owner: str) -> None:
        if not self._queues.get(owner):
            self._queues.pop(owner, None)
            if owner in self._turns:
                self._turns.remove(owner)

    def _next(self) -> _Queued | None:
        """The next owner's next call (the owner goes to the back of the line)."""
        with self._lock:
            while not self._turns and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            owner = self._turns.popleft()
            item = self._queues[owner].popleft()
            if self._queues[owner]:
                self._turns.append(owner)
            else:
                del self._queues[owner]
            return item

    def _work(self) -> None:
        while (item := self._next()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # the future carries it to its caller
                future.set_exception(error)
