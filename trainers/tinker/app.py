"""The Tinker REST API (the routes SDK 0.38 calls) over a `TinkerService`.

Every compute call returns a future at once ({"request_id": ...}); the work runs on one
worker thread, the owners (API keys) taking turns (`trainers.tinker.futures`), and the SDK
polls /api/v1/retrieve_future, which waits up to `POLL_SECONDS` and then answers try_again.
A failed future answers {"error", "category"}: `user` for bad input (the SDK raises
RequestFailedError), `server` for anything else; the server stays up either way. Input the
route can check at once answers 400 (BadRequestError); ids of another owner's sessions,
training clients, samplers, runs and futures answer as ids that do not exist (404).
forward_backward arrives as protobuf, and its output and sample's go back as protobuf (the
SDK accepts no JSON for those two); the rest is JSON.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agents.api_keys import read_keys
from trainers.tinker import checkpoints, fields
from trainers.tinker.errors import NotFound, QuotaExceeded, TooLarge, TooMany, UserError
from trainers.tinker.futures import POLL_SECONDS, Futures
from trainers.tinker.gate import OWNER, Gate
from trainers.tinker.service import TinkerService
from trainers.tinker.wire import decode_forward_backward, encode_forward_backward, encode_sample

__all__ = ["POLL_SECONDS", "build_app", "in_thread"]

Keys = str | Sequence[str] | Mapping[str, str] | None
"""API keys: one entry (`KEY` or `USER KEY`), several, or each key with its user."""


def build_app(service: TinkerService, api_key: Keys = None) -> FastAPI:
    """The app; with keys (`api_key`: one entry, several, or keys and the users they name;
    `agents.api_keys`), every request must carry one of them as X-API-Key, and sees only
    what its key's user made."""
    app = FastAPI(title="clawgym tinker")
    futures = Futures(service.limits.max_queued)
    app.state.futures = futures
    users = _users(api_key)
    app.add_middleware(Gate, users=users, max_body_bytes=service.limits.max_body_bytes)
    statuses: dict[type[Exception], int] = {NotFound: 404, TooMany: 429, TooLarge: 413}
    statuses[QuotaExceeded] = 403
    statuses[UserError] = 400  # refused before a future exists: the SDK's BadRequestError
    for error_type, status in statuses.items():
        app.add_exception_handler(error_type, partial(_refuse, status))
    _service_routes(app, service, futures)
    _training_routes(app, service, futures)
    _step_routes(app, service, futures)
    _sampling_routes(app, service, futures)
    _rest_routes(app, service, futures)
    return app


@contextlib.contextmanager
def in_thread(
    service: TinkerService,
    api_key: Keys = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[str]:
    """Serves the Tinker API on `service` from a thread of this process until the block ends
    (tests, notebooks, a trainer beside its own server); port 0 takes a free one. Yields the
    base URL clients take as TINKER_BASE_URL."""
    from agents.serving.server import uvicorn_in_thread

    app = build_app(service, api_key)
    try:
        with uvicorn_in_thread(app, host, port, **uvicorn_options(service)) as bound:
            yield f"http://{host}:{bound}"
    finally:
        app.state.futures.close()


def uvicorn_options(service: TinkerService) -> dict:
    """How uvicorn serves the app: the proxy's HTTP protocol, which closes connections that
    idle or send slowly (`agents.serving.http_protocol`), with this server's limits."""
    from agents.serving.http_protocol import http_protocol

    limits = service.limits
    protocol = http_protocol(limits.idle_timeout_s, limits.request_timeout_s)
    return {"http": protocol, "access_log": False, "proxy_headers": False}


def _users(api_key: Keys) -> dict[str, str]:
    """Each key and the user it names."""
    if isinstance(api_key, Mapping):
        return dict(api_key)
    return read_keys([api_key] if isinstance(api_key, str) else api_key or ())


async def _refuse(status: int, request: Request, error: Exception) -> Response:
    return JSONResponse({"detail": str(error)}, status_code=status)


def _owner(request: Request) -> str:
    return str(request.scope["state"][OWNER])


def _service_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """Health, capabilities, the SDK's client config, sessions and futures."""
    constant: dict[str, dict] = {
        "/api/v1/client/config": {"pjwt_auth_enabled": False, "use_pyqwest_transport": False},
        "/api/v1/client/dynamic_config": {"sample_cancel_enabled": True},
        "/api/v1/telemetry": {"status": "accepted"},
        "/api/v1/session_heartbeat": {"type": "session_heartbeat"},
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
    async def create_session(request: Request) -> dict:
        return {"type": "create_session", "session_id": service.open_session(_owner(request))}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict:
        """Sent when a `with ServiceClient(...)` block exits: frees its learners and samplers."""
        owner = _owner(request)
        service.check_session(owner, session_id)
        await futures.run(owner, partial(service.finish_session, owner, session_id))
        return {}

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Response:
        body = await fields.json_body(request)
        return await futures.answer(_owner(request), body.get("request_id"))

    @app.post("/api/v1/cancel_future")
    async def cancel(request: Request) -> dict:
        body = await fields.json_body(request)
        return {"cancelled": futures.cancel(_owner(request), body.get("request_id"))}


def _training_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """Training clients: create, info, save and load (steps: `_step_routes`)."""

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        model_id = service.model_id(owner, body.get("session_id"), body.get("model_seq_id"))
        rank, seed, attn, mlp = fields.lora(body.get("lora_config"))
        base = fields.text(body.get("base_model"), "base_model")
        service.check_rank(rank)
        service.check_capacity(owner)

        def run() -> dict:
            service.create_model(model_id, str(base), rank, seed, attn, mlp, owner)
            return {"type": "create_model", "model_id": model_id}

        return _future(futures.submit(owner, run), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        model_id = service.check_owner(
            _owner(request), (await fields.json_body(request)).get("model_id")
        )
        rank = service.learner(model_id).model.peft_config["default"].r
        data = {"model_name": service.model_name, "tokenizer_id": service.tokenizer_id()}
        info = {"model_id": model_id, "model_data": data, "is_lora": True, "lora_rank": rank}
        return {"type": "get_info"} | info

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        model_id = service.check_owner(owner, body.get("model_id"))
        name = checkpoints.check_name(body.get("path"))
        service.check_room(owner, model_id, "weights", name)

        def run() -> dict:
            return {"type": "save_weights", "path": service.save(model_id, "weights", name)}

        return _future(futures.submit(owner, run), model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        if body.get("model_id") is not None:
            model_id = service.check_owner(owner, body.get("model_id"))
        else:
            model_id = service.model_id(owner, body.get("session_id"), body.get("model_seq_id"))
            service.check_capacity(owner)
        path = str(fields.text(body.get("path"), "path"))
        optimizer = fields.flag(body.get("optimizer", False), "optimizer")

        def run() -> dict:
            service.load(model_id, path, optimizer, owner)
            return {"type": "load_weights", "path": path, "model_id": model_id}

        return _future(futures.submit(owner, run), model_id)


def _step_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """A training client's steps (forward_backward, optim_step) and its unloading."""

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request) -> dict:
        owner = _owner(request)
        model_id = service.check_owner(owner, (await fields.json_body(request)).get("model_id"))

        def run() -> dict:
            service.unload(model_id)
            return {"type": "unload_model", "model_id": model_id}

        return _future(futures.submit(owner, run), model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        owner = _owner(request)
        try:
            call = decode_forward_backward(await request.body())
        except TooLarge:
            raise
        except UserError as error:  # the SDK reads a malformed body's failure off its future
            failure = error

            def fail() -> bytes:
                raise failure

            return _future(futures.submit(owner, fail))
        service.check_owner(owner, call.model_id)
        service.check_data(call.data)

        def run() -> bytes:
            outputs, metrics = service.forward_backward(
                call.model_id, call.loss_fn, call.config, call.data, call.forward_only
            )
            return encode_forward_backward(outputs, metrics)

        return _future(futures.submit(owner, run), call.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        model_id = service.check_owner(owner, body.get("model_id"))
        adam = fields.adam(body.get("adam_params"))

        def run() -> dict:
            return {"type": "optim_step", "metrics": service.optim_step(model_id, adam)}

        return _future(futures.submit(owner, run), model_id)


def _sampling_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """Sampler checkpoints, sampling sessions and sample (compute_logprobs is a sample)."""

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        model_id = service.check_owner(owner, body.get("model_id"))
        # without a name the SDK wants a sampling session on a snapshot of the weights now
        name = body.get("path")
        name = None if name is None else checkpoints.check_name(name)
        if name is not None:
            service.check_room(owner, model_id, "sampler_weights", name)

        def run() -> dict:
            if name is not None:
                return {"path": service.save(model_id, "sampler_weights", name)}
            return {"sampling_session_id": service.snapshot_sampler(model_id)}

        return _future(futures.submit(owner, run), model_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        session = service.check_session(owner, body.get("session_id"))
        path = fields.text(body.get("model_path"), "model_path", optional=True)
        base = fields.text(body.get("base_model"), "base_model", optional=True)
        opened = partial(service.open_sampler, path, base, owner, session)
        return {
            "type": "create_sampling_session",
            "sampling_session_id": await futures.run(owner, opened),
        }

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> dict:
        record = service.sampler_session(_owner(request), sampler_id)
        path = record.path
        return {"sampler_id": sampler_id, "base_model": service.model_name, "model_path": path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        owner, body = _owner(request), await fields.json_body(request)
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:
            path = fields.text(body.get("model_path"), "model_path", optional=True)
            base = fields.text(body.get("base_model"), "base_model", optional=True)
            sampler_id = await futures.run(owner, partial(service.open_sampler, path, base, owner))
        service.sampler_session(owner, sampler_id)
        prompt = fields.prompt_tokens(body.get("prompt"))
        params = fields.sampling_params(body.get("sampling_params") or {})
        count = fields.integer(body.get("num_samples", 1), "num_samples")
        scored = fields.flag(bool(body.get("prompt_logprobs")), "prompt_logprobs")
        service.check_sample(prompt, count, params)

        def run() -> bytes:
            return encode_sample(*service.sample(sampler_id, prompt, count, params, scored))

        request_id = futures.submit(owner, run)
        ids = [f"{request_id}-{i}" for i in range(count)]
        return _future(request_id) | {"sample_sequence_ids": ids}


def _rest_routes(app: FastAPI, service: TinkerService, futures: Futures) -> None:
    """The RestClient's training runs and checkpoints, read from the run directory (so a
    restarted server lists its earlier runs too), the caller's own only."""
    run_dir = service.run_dir

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
        if limit < 1 or offset < 0:
            raise UserError(f"limit must be positive and offset not negative: {limit}, {offset}")
        owner = _owner(request)
        runs = await futures.run(owner, partial(checkpoints.training_runs, run_dir, owner))
        cursor = {"offset": offset, "limit": limit, "total_count": len(runs)}
        return {"training_runs": runs[offset : offset + limit], "cursor": cursor}

    @app.get("/api/v1/training_runs/{model_id}")
    async def get_training_run(model_id: str, request: Request) -> dict:
        owner = _owner(request)
        return await futures.run(owner, partial(checkpoints.training_run, run_dir, model_id, owner))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request) -> dict:
        owner = _owner(request)
        listed = partial(checkpoints.checkpoint_list, run_dir, model_id, owner)
        return {"checkpoints": await futures.run(owner, listed)}

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request) -> None:
        owner = _owner(request)
        await futures.run(owner, partial(service.delete_checkpoint, model_id, checkpoint_id, owner))

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict:
        owner = _owner(request)
        path = str(fields.text((await fields.json_body(request)).get("tinker_path"), "tinker_path"))
        return await futures.run(owner, partial(checkpoints.weights_info, run_dir, path, owner))


async def _constant(answer: dict) -> dict:
    return answer


def _future(request_id: str, model_id: str | None = None) -> dict:
    return {"request_id": request_id, "model_id": model_id}
