"""Serving performance: the proxy's overhead, its request rate, adapter publishing under
load, and aggregate generation throughput of each engine against plain transformers.

    python -m benchmarks.perf.serving [--requests 150] [--servers 3] [--tokens 32] [--skip-vllm]

Prints two tables. The proxy runs as `python -m agents.serve` in a subprocess on the
`tiny` model (one thread); "overhead" is the paired difference between a request through
it (HTTP, validation, session bookkeeping, a committed turn) and the same request to an
engine called directly in this process, one token each, over `--servers` proxy processes
taken in turn. The target row's client is the standard library's `http.client`; httpx
(the openai client's transport) adds about a millisecond of its own, reported below, and
the floor row is the same client's round trip to a server that does nothing on the same
stack (`benchmarks.perf.noop_server`). The throughput table, on `smollm2-135m`, is
`benchmarks.perf.throughput`'s: plain transformers `generate` (the baseline), the embedded
engine, vLLM called directly and vLLM through the proxy.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.console import Console
from rich.table import Table

from agents import models
from agents.engines.base import Engine, SamplingParams
from agents.engines.embedded import EmbeddedEngine
from agents.engines.vllm_server import free_port
from agents.store import Store
from benchmarks.perf import throughput

MESSAGES = [{"role": "user", "content": "Say hi."}]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def proxy_process(
    store: Path, admin_key: str, *args: str
) -> contextlib.AbstractContextManager[tuple[str, int]]:
    """`python -m agents.serve` on a free port, with `admin_key` for its admin routes;
    yields its base URL (without /v1), pid."""
    port = free_port()
    command = ["-m", "agents.serve", f"serve.port={port}", f"store={store}", *args]
    env = {**os.environ, "CLAWGYM_API_KEY": "", "CLAWGYM_ADMIN_KEY": admin_key}
    return _server_process(port, command, env=env)


def noop_process() -> contextlib.AbstractContextManager[tuple[str, int]]:
    """`benchmarks.perf.noop_server` on a free port; yields its base URL and pid."""
    port = free_port()
    return _server_process(port, ["-m", "benchmarks.perf.noop_server", str(port)])


@contextmanager
def _server_process(
    port: int, arguments: list[str], env: dict[str, str] | None = None
) -> Iterator[tuple[str, int]]:
    """`python *arguments`, serving on `port`, stopped on exit; yields its base URL and
    pid once its `/healthz` answers."""
    server = subprocess.Popen([sys.executable, *arguments], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server)
        yield base, server.pid
    finally:
        server.terminate()
        server.wait(timeout=60)


def _wait_healthy(base: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the proxy did not come up")


def chat(client: httpx.Client, base: str, session: str, max_tokens: int, **extra: Any) -> Any:
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens, **extra}
    response = client.post(
        base + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}
    )
    response.raise_for_status()
    if extra.get("stream"):
        if not response.text.rstrip().endswith("data: [DONE]"):
            raise httpx.HTTPError("the stream did not end with [DONE]")
        return response.text
    return response.json()


@dataclass(frozen=True)
class Overhead:
    """Seconds per one-token request, paired round by round, per proxy process."""

    direct: list[list[float]]
    stdlib: list[list[float]]
    """Through the proxy with `http.client` (a lean client: the proxy's own cost)."""
    httpx: list[list[float]]
    """Through the proxy with httpx, the openai client's transport."""
    cpu_direct: float
    """CPU seconds a request in this process, engine direct."""
    cpu_proxy: float
    """CPU seconds a request in the proxy's process."""
    floor: list[float]
    """A request to `benchmarks.perf.noop_server` (same client, same stack, no work)."""

    def diffs(self, proxied: list[list[float]]) -> list[list[float]]:
        return [
            [p - d for p, d in zip(ps, ds, strict=True)]
            for ps, ds in zip(proxied, self.direct, strict=True)
        ]


def overhead(engine: Engine, servers: list[tuple[str, int]], floor: str, requests: int) -> Overhead:
    """Each round, for each proxy process in turn: the engine called directly, then the
    same request through that proxy with each client (one token each); then the engine
    again and the no-op server at `floor`. Several proxy processes because one process's
    figure moves by a few tenths of a millisecond from one start to the next here; CPU
    time is robust to other load."""
    one = SamplingParams(temperature=1.0, max_tokens=1)
    count = len(servers)
    direct: list[list[float]] = [[] for _ in servers]
    stdlib: list[list[float]] = [[] for _ in servers]
    with_httpx: list[list[float]] = [[] for _ in servers]
    cpu_direct = cpu_proxy = 0.0
    body = json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": 1, "temperature": 1})
    headers = {"Content-Type": "application/json", "X-Session-Id": "overhead"}
    connections = [
        http.client.HTTPConnection("127.0.0.1", int(base.rpartition(":")[2])) for base, _ in servers
    ]
    noop = http.client.HTTPConnection("127.0.0.1", int(floor.rpartition(":")[2]))
    floors: list[float] = []
    with httpx.Client(timeout=60) as client:
        for number in range(requests + 5):
            engine.generate(MESSAGES, sampling=one)  # the same state as before a proxy call
            started = time.perf_counter()
            noop.request("POST", "/v1/chat/completions", body, headers)
            noop.getresponse().read()
            if number >= 5:
                floors.append(time.perf_counter() - started)
            for index in [(number + k) % count for k in range(count)]:  # each first in turn
                (base, pid), connection = servers[index], connections[index]
                started, cpu = time.perf_counter(), time.process_time()
                engine.generate(MESSAGES, sampling=one)
                ended, cpu_ended = time.perf_counter(), time.process_time()
                server_cpu = _cpu(pid)
                middle = time.perf_counter()
                connection.request("POST", "/v1/chat/completions", body, headers)
                reply = connection.getresponse()
                if reply.status != 200:
                    raise RuntimeError(f"the proxy answered {reply.status}: {reply.read()!r}")
                reply.read()
                after_stdlib = time.perf_counter()
                chat(client, base, "overhead", 1, temperature=1.0)
                if number >= 5:  # warm-up
                    direct[index].append(ended - started)
                    stdlib[index].append(after_stdlib - middle)
                    with_httpx[index].append(time.perf_counter() - after_stdlib)
                    cpu_direct += cpu_ended - cpu
                    cpu_proxy += (_cpu(pid) - server_cpu) / 2
    for connection in [*connections, noop]:
        connection.close()
    rounds = requests * count
    return Overhead(direct, stdlib, with_httpx, cpu_direct / rounds, cpu_proxy / rounds, floors)


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests_per_second(base: str, sessions: int, per_session: int, tokens: int) -> float:
    def session(number: int) -> None:
        with httpx.Client(timeout=300) as client:
            for _ in range(per_session):
                chat(client, base, f"rps-{sessions}-{number}", tokens)

    started = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(session, range(sessions)))
    return sessions * per_session / (time.perf_counter() - started)


def publish_under_load(
    base: str, store: Path, adapters: list[str], admin_key: str
) -> tuple[list[float], int, int]:
    """Publishes each adapter (with the proxy's `admin_key`) while 8 sessions keep
    requesting; returns the publish latencies (until every later request runs on the new
    version), failed requests and served requests."""
    stop, failed, served = threading.Event(), [0], [0]

    def load(number: int) -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                try:
                    chat(client, base, f"load-{number}", 4, stream=number % 2 == 0)
                    served[0] += 1
                except httpx.HTTPError:
                    failed[0] += 1

    workers = [threading.Thread(target=load, args=(n,)) for n in range(8)]
    for worker in workers:
        worker.start()
    latencies = []
    with httpx.Client(timeout=300) as client, Store(store) as turns:
        for version, path in enumerate(adapters, start=1):
            time.sleep(0.5)
            started = time.perf_counter()
            client.post(
                base + "/admin/adapters",
                json={"path": path, "version": version},
                headers={"Authorization": f"Bearer {admin_key}"},
            ).raise_for_status()
            latencies.append(time.perf_counter() - started)
            chat(client, base, f"probe-{version}", 1)
            if turns.session(f"probe-{version}").turns[0].policy_version != version:
                raise RuntimeError(f"version {version} was published but not served")
    stop.set()
    for worker in workers:
        worker.join()
    return latencies, failed[0], served[0]


def random_adapters(root: Path, count: int) -> list[str]:
    from peft import LoraConfig, get_peft_model

    paths = []
    for version in range(1, count + 1):
        model, _ = models.load("tiny")
        torch.manual_seed(version)
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        get_peft_model(model, config).save_pretrained(root / f"v{version}")
        paths.append(str(root / f"v{version}"))
    return paths


def _median(per_process: list[list[float]]) -> float:
    return statistics.median([value for values in per_process for value in values])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclass(frozen=True)
class ProxyRun:
    """What the proxy processes measured: overhead, request rates, publishes under load."""

    measured: Overhead
    rates: dict[int, float]
    """Requests/s by concurrent sessions (8 tokens a request)."""
    latencies: list[float]
    """Seconds from each publish to the version served, 8 sessions loading."""
    failed: int
    served: int


def run_proxies(args: argparse.Namespace, tmp: Path, adapters: list[str]) -> ProxyRun:
    """Overhead over `args.servers` proxy processes, then request rates and publishes under
    load on the first one alone."""
    # Slots prepared as the trainer prepares them: every publish below is a copy. The
    # engine called directly is prepared the same way, so that the overhead is the
    # proxy's alone: peft's wrapped layers cost a base-model forward pass about
    # 0.25 ms here, with or without the proxy.
    direct = EmbeddedEngine("tiny", threads=1)
    direct.prepare_adapter(adapters[0])
    serve = (
        "model=tiny",
        "engine.threads=1",
        "serve.log_level=warning",
        f"adapter_shape={adapters[0]}",
    )
    stores = [tmp / f"store{i}.sqlite" for i in range(args.servers)]
    key = secrets.token_urlsafe(16)
    with proxy_process(stores[0], key, *serve) as first, contextlib.ExitStack() as others:
        servers = [first]
        servers += [others.enter_context(proxy_process(s, key, *serve)) for s in stores[1:]]
        floor, _ = others.enter_context(noop_process())
        measured = overhead(direct, servers, floor, args.requests)
        direct.close()
        others.close()  # the rest of the table has the cores to one proxy
        base = first[0]
        rates = {c: requests_per_second(base, c, max(2, 64 // c), 8) for c in (1, 8, 32)}
        latencies, failed, served = publish_under_load(base, stores[0], adapters[:4], key)
    return ProxyRun(measured, rates, latencies, failed, served)


def idle_publishes(adapters: Sequence[str]) -> tuple[float, float]:
    """Seconds to publish the first version and a later one on an idle engine without
    prepared slots: the first version of a LoRA shape is loaded by peft, which makes its
    slots; every later one is copied into a free slot."""
    engine = EmbeddedEngine("tiny", threads=1)
    started = time.perf_counter()
    engine.load_adapter(adapters[0], 1)
    first = time.perf_counter() - started
    engine.score([1, 2], [3])  # one scheduler round: the spare slots are made by then
    started = time.perf_counter()
    engine.load_adapter(adapters[1], 2)
    later = time.perf_counter() - started
    engine.close()
    return first, later


def proxy_table(args: argparse.Namespace) -> Table:
    table = Table(title="proxy on tiny (python -m agents.serve, embedded engine, 1 thread)")
    for column in ("measure", "value", "target"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = random_adapters(Path(tmp), 6)
        run = run_proxies(args, Path(tmp), adapters)
        idle_first, idle_publish = idle_publishes(adapters[4:])
    measured, rates, latencies = run.measured, run.rates, run.latencies
    stdlib, with_httpx = measured.diffs(measured.stdlib), measured.diffs(measured.httpx)
    every = [d for process in stdlib for d in process]
    table.add_row("engine direct p50, 1 token", _ms(_median(measured.direct)), "")
    table.add_row("through proxy p50, 1 token", _ms(_median(measured.stdlib)), "")
    table.add_row(
        f"proxy overhead p50 ({args.servers} processes x {args.requests})",
        _ms(statistics.median(every)),
        "<= 2 ms",
    )
    table.add_row(
        "  p50 of each process", " / ".join(f"{statistics.median(p) * 1e3:.2f}" for p in stdlib), ""
    )
    table.add_row("proxy overhead p99", _ms(percentile(every, 0.99)), "")
    table.add_row(
        "  floor: round trip to a no-op server p50", _ms(statistics.median(measured.floor)), ""
    )
    table.add_row("  with httpx as the client, p50", _ms(_median(with_httpx)), "")
    table.add_row("CPU per request, engine direct", _ms(measured.cpu_direct), "")
    table.add_row("CPU per request, proxy process", _ms(measured.cpu_proxy), "")
    for concurrency, rate in rates.items():
        table.add_row(f"requests/s, {concurrency} sessions, 8 tokens", f"{rate:.1f}", "")
    table.add_row(
        f"publish to served, max of {len(latencies)} (8 sessions loading)",
        f"{max(latencies) * 1e3:.0f} ms",
        "<= 100 ms",
    )
    table.add_row("  first version (slots prepared)", f"{latencies[0] * 1e3:.0f} ms", "")
    table.add_row(
        "failed requests during publishes", f"{run.failed} of {run.served + run.failed}", "0"
    )
    table.add_row("publish to served, idle engine", f"{idle_publish * 1e3:.0f} ms", "<= 100 ms")
    table.add_row(
        "  first version, idle, no slots prepared (peft loads)", f"{idle_first * 1e3:.0f} ms", ""
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=150, help="overhead rounds for each proxy process"
    )
    parser.add_argument("--servers", type=int, default=3, help="proxy processes for overhead")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a throughput request")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (smollm2 rows)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="alternated vLLM passes (median)")
    parser.add_argument("--only", choices=("proxy", "throughput"), default=None)
    args = parser.parse_args()
    console = Console()
    console.print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.only != "throughput":
        console.print(proxy_table(args))
    if args.only != "proxy":
        console.print(throughput.throughput_table(args))
    console.print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
