"""The Tinker REST API (the routes SDK 0.38 calls) over a `TinkerService`.

Every compute call returns a future at once ({"request_id": ...}); the work runs in order on
one worker thread, and the SDK polls /api/v1/retrieve_future, which waits up to
`POLL_SECONDS` and then answers try_again. A failed future answers {"error", "category"}:
`user` for bad input (the SDK raises RequestFailedError), `server` for anything else; the
server stays up either way. forward_backward arrives as protobuf, and its output and
sample's go back as protobuf (the SDK accepts no JSON for those two); the rest is JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from trainers.tinker import checkpoints
from trainers.tinker.errors import NotFound, UserError
from trainers.tinker.service import SamplingParams, TinkerService
from trainers.tinker.wire import decode_forward_backward, encode_forward_backward, encode_sample

logger = logging.getLogger(__name__)

POLL_SECONDS = 20.0
"""How long one retrieve_future waits before answering try_again."""


KEPT_FUTURES = 4096
"""Finished futures kept for (re)retrieval; older ones are forgotten."""


class Futures:
    """Calls queued on one worker thread, by request id."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker")
        self._futures: dict[str, Future] = {}
        self._ids = itertools.count()

    def submit(self, call: Callable[[], Any]) -> str:
        request_id = f"req-{next(self._ids)}"
        self._futures[request_id] = self._pool.submit(call)
        if len(self._futures) > KEPT_FUTURES:
            oldest = next(iter(self._futures))
            if self._futures[oldest].done():
                del self._futures[oldest]
        return request_id

    async def answer(self, request_id: str) -> Response:
        future = self._futures.get(request_id)
        if future is None:
            return JSONResponse({"error": f"unknown request_id {request_id!r}", "category": "user"})
        try:
            result = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), POLL_SECONDS
            )
        except TimeoutError:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        except UserError as error:
            return JSONResponse({"error": str(error), "category": "user"})
        except Exception as error:
            logger.exception("request %s failed", request_id)
            return JSONResponse({"error": f"{type(error).__name__}: {error}", "category": "server"})
        if isinstance(result, bytes):
            return Response(result, media_type="application/x-protobuf")
        return JSONResponse(result)

    async def run(self, call: Callable[[], Any]) -> Any:
        """`call` on the worker thread, in order with the queued calls, awaited here (for
        the REST routes, which answer at once rather than with a future)."""
        return await asyncio.wrap_future(self._pool.submit(call))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_app(service: TinkerService, api_key: str | None = None) -> FastAPI:
    """The app; with `api_key`, every request must carry it as X-API-Key."""
    app = FastAPI(title="clawgym tinker")
    futures = Futures()
    app.state.futures = futures

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Callable) -> Response:
        supplied = request.headers.get("x-api-key", "")
        if api_key is not None and not secrets.compare_digest(supplied, api_key):
            return JSONResponse({"detail": "invalid or missing X-API-Key"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(UserError)
    async def bad_request(request: Request, error: UserError) -> Response:
        """Input refused before a future exists: the SDK raises BadRequestError."""
        return JSONResponse({"detail": str(error)}, status_code=400)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, error: NotFound) -> Response:
        return JSONResponse({"detail": str(error)}, status_code=404)

    _service_routes(app, service, futures)
    _training_routes(app, service, futures)
    _step_routes(app, service, futures)
    _sampling_routes(app, service, futures)
    _rest_routes(app, service, futures)
    return app


@contextlib.contextmanager
def in_thread(
    service: TinkerService, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0
) -> Iterator[str]:
    """Serves the Tinker API on `service` from a thread of this process until the block ends
    (tests, notebooks, a trainer beside its own server); port 0 takes a free one. Yields the
    base URL clients take as TINKER_BASE_URL."""
    from agents.serving.server import uvicorn_in_thread

    app = build_app(service, api_key)
    try:
        with uvicorn_in_thread(app, host, port) as bound:
            yield f"http://{host}:{bound}"
    finally:
        app.state.futures.close()


def _service_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """Health, capabilities, the SDK's client config, sessions and futures."""
    sessions = itertools.count()
    constant: dict[str, dict] = {
        "/api/v1/client/config": {"pjwt_auth_enabled": False, "use_pyqwest_transport": False},
        "/api/v1/client/dynamic_config": {},
        "/api/v1/telemetry": {"status": "accepted"},
        "/api/v1/session_heartbeat": {"type": "session_heartbeat"},
        "/api/v1/cancel_future": {},
    }
    for route, answer in constant.items():
        app.add_api_route(route, partial(_constant, answer), methods=["POST"])

    @app.get("/api/v1/healthz")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": service.capabilities()}

    @app.post("/api/v1/create_session")
    async def create_session() -> dict:
        # random, so a restarted server never reuses an earlier run's checkpoint directories
        session_id = f"session-{next(sessions)}-{secrets.token_hex(4)}"
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> dict:
        """Sent when a `with ServiceClient(...)` block exits; nothing is held per session."""
        return {}

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Response:
        return await futures.answer(str((await _json(request)).get("request_id")))


def _training_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """Training clients: create, info, save and load (their steps: `_step_routes`)."""

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        body = await _json(request)
        model_id = f"{body.get('session_id')}:train:{body.get('model_seq_id')}"
        lora = body.get("lora_config") or {}
        rank, seed = int(lora.get("rank", 32)), lora.get("seed")
        attn, mlp = bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True))

        def run() -> dict:
            service.create_model(model_id, str(body.get("base_model")), rank, seed, attn, mlp)
            return {"type": "create_model", "model_id": model_id}

        return _future(futures.submit(run), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        model_id = str((await _json(request)).get("model_id"))
        rank = service.learner(model_id).model.peft_config["default"].r
        data = {"model_name": service.model_name, "tokenizer_id": service.tokenizer_id()}
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": data,
            "is_lora": True,
            "lora_rank": rank,
        }

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        body = await _json(request)
        model_id, name = str(body.get("model_id")), str(body.get("path") or "")

        def run() -> dict:
            return {"type": "save_weights", "path": service.save(model_id, "weights", name)}

        return _future(futures.submit(run), model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        body = await _json(request)
        model_id = (
            body.get("model_id") or f"{body.get('session_id')}:train:{body.get('model_seq_id')}"
        )
        path, optimizer = str(body.get("path")), bool(body.get("optimizer"))

        def run() -> dict:
            service.load(model_id, path, optimizer)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return _future(futures.submit(run), model_id)


def _step_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """A training client's steps: forward_backward and optim_step."""

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        body = await request.body()

        def run() -> bytes:
            call = decode_forward_backward(body)
            outputs, metrics = service.forward_backward(
                call.model_id, call.loss_fn, call.config, call.data, call.forward_only
            )
            return encode_forward_backward(outputs, metrics)

        return _future(futures.submit(run))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        body = await _json(request)
        model_id, adam = str(body.get("model_id")), body.get("adam_params")
        if not isinstance(adam, dict):
            raise UserError("optim_step needs adam_params; other optimizers are not served")

        def run() -> dict:
            return {"type": "optim_step", "metrics": service.optim_step(model_id, adam)}

        return _future(futures.submit(run), model_id)


def _sampling_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """Sampler checkpoints, sampling sessions and sample (compute_logprobs is a sample)."""
    ephemeral = itertools.count()

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        body = await _json(request)
        model_id, name = str(body.get("model_id")), body.get("path")
        # without a name the SDK wants a sampling session on a snapshot of the weights now
        snapshot = f"snapshot-{next(ephemeral)}"

        def run() -> dict:
            if name is not None:
                return {"path": service.save(model_id, "sampler_weights", str(name))}
            path = service.save(model_id, "sampler_weights", snapshot)
            return {"sampling_session_id": service.open_sampler(path, None)}

        return _future(futures.submit(run), model_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        body = await _json(request)
        sampler_id = service.open_sampler(body.get("model_path"), body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str) -> dict:
        if sampler_id not in service.samplers:
            raise UserError(f"unknown sampling session {sampler_id!r}")
        path = service.samplers[sampler_id]
        return {"sampler_id": sampler_id, "base_model": service.model_name, "model_path": path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        body = await _json(request)
        sampler_id = body.get("sampling_session_id") or service.open_sampler(
            body.get("model_path"), body.get("base_model")
        )
        prompt = _prompt_tokens(body.get("prompt"))
        params = _sampling_params(body.get("sampling_params") or {})
        count, scored = int(body.get("num_samples", 1)), bool(body.get("prompt_logprobs"))

        def run() -> bytes:
            return encode_sample(*service.sample(sampler_id, prompt, count, params, scored))

        request_id = futures.submit(run)
        ids = [f"{request_id}-{i}" for i in range(count)]
        return _future(request_id) | {"sample_sequence_ids": ids}


def _rest_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """The RestClient's training runs and checkpoints, read from the run directory (so a
    restarted server lists its earlier runs too)."""
    run_dir = service.run_dir

    @app.get("/api/v1/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict:
        if limit < 1 or offset < 0:
            raise UserError(f"limit must be positive and offset not negative: {limit}, {offset}")
        runs = await futures.run(partial(checkpoints.training_runs, run_dir))
        cursor = {"offset": offset, "limit": limit, "total_count": len(runs)}
        return {"training_runs": runs[offset : offset + limit], "cursor": cursor}

    @app.get("/api/v1/training_runs/{model_id}")
    async def get_training_run(model_id: str) -> dict:
        return await futures.run(partial(checkpoints.training_run, run_dir, model_id))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str) -> dict:
        listed = await futures.run(partial(checkpoints.checkpoint_list, run_dir, model_id))
        return {"checkpoints": listed}

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> None:
        await futures.run(partial(service.delete_checkpoint, model_id, checkpoint_id))

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict:
        path = str((await _json(request)).get("tinker_path"))
        return await futures.run(partial(checkpoints.weights_info, run_dir, path))


async def _constant(answer: dict) -> dict:
    return answer


def _future(request_id: str, model_id: str | None = None) -> dict:
    return {"request_id": request_id, "model_id": model_id}


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as error:
        raise UserError(f"malformed JSON body: {error}") from error
    if not isinstance(body, dict):
        raise UserError("the JSON body must be an object")
    return body


def _prompt_tokens(prompt: Any) -> list[int]:
    """The token ids of a ModelInput's encoded_text chunks."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise UserError("prompt must be a ModelInput with chunks")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type") != "encoded_text":
            raise UserError("only encoded_text prompt chunks are served")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens


def _sampling_params(raw: dict) -> SamplingParams:
    stop = raw.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    max_tokens = raw.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 0:
        raise UserError("sampling_params.max_tokens must be a non-negative integer")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(raw.get("temperature", 1.0)),
        top_k=int(raw.get("top_k", -1)),
        top_p=float(raw.get("top_p", 1.0)),
        seed=raw.get("seed"),
        stop_tokens=tuple(s for s in stop if isinstance(s, int)),
        stop_strings=tuple(s for s in stop if isinstance(s, str)),
    )
