"""A soak of clawgym's Tinker server: N SDK clients, each with its own API key, each running
an RL-style loop (save sampler weights and open a sampler on them, sample a group, one
importance-sampling forward_backward, optim_step) for S steps at once against one server.

    python -m benchmarks.perf.tinker_soak [--clients 8] [--steps 200] [--model tiny]
        [--group 4] [--max-tokens 8] [--points 10]

The server runs as `python -m trainers.tinker` in a subprocess; its resident memory
(VmRSS) is sampled every half second. It prints the memory curve (after warm-up, the
first tenth of the steps, it should stay flat: learners, samplers and snapshots are
released as the loop moves on), each client's p50 and p99 wait per request (no client
starved: the owners take turns), and the count of 5xx answers and failed requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 5, 9, 200, 31, 7]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_server(
    model: str, keys: list[str], run_dir: Path, log: Path
) -> tuple[subprocess.Popen, str]:
    """`python -m trainers.tinker` with one key per client, its stderr to `log`."""
    port = _free_port()
    command = [sys.executable, "-m", "trainers.tinker", f"model={model}", f"tinker.port={port}"]
    command += [f"tinker.run_dir={run_dir}", f"tinker.api_keys=[{','.join(keys)}]"]
    with log.open("wb") as sink:
        server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            health = httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": keys[0]}, timeout=1)
            if health.status_code == 200:
                return server, url
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("the Tinker server did not answer in 3 minutes")


class Client(threading.Thread):
    """One SDK client's RL loop; `waits` holds each request's wait in seconds."""

    def __init__(self, url: str, key: str, model: str, args: argparse.Namespace):
        super().__init__(daemon=True)
        self.url, self.key, self.model, self.args = url, key, model, args
        self.waits: list[float] = []
        self.steps_done = 0
        self.failures: list[str] = []

    def _wait(self, future):
        started = time.monotonic()
        result = future.result()
        self.waits.append(time.monotonic() - started)
        return result

    def run(self) -> None:
        import tinker
        from tinker import types

        try:
            with tinker.ServiceClient(base_url=self.url, api_key=self.key) as service:
                trainer = self._wait(
                    service.create_lora_training_client(base_model=self.model, rank=4)
                )
                for _ in range(self.args.steps):
                    self._step(trainer, types)
                    self.steps_done += 1
        except Exception as error:  # counted and reported: the soak's figure, not a crash
            self.failures.append(f"{type(error).__name__}: {str(error)[:200]}")

    def _step(self, trainer, types) -> None:
        sampler = self._wait(trainer.save_weights_and_get_sampling_client())
        params = types.SamplingParams(max_tokens=self.args.max_tokens)
        prompt = types.ModelInput.from_ints(PROMPT)
        sampled = self._wait(sampler.sample(prompt, self.args.group, params)).sequences
        rewards = [sum(t % 2 == 0 for t in s.tokens) / max(len(s.tokens), 1) for s in sampled]
        mean = statistics.fmean(rewards)
        data = []
        for sequence, reward in zip(sampled, rewards, strict=True):
            tokens = PROMPT + list(sequence.tokens)
            shift = len(PROMPT) - 1
            inputs = {
                "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                "logprobs": types.TensorData(
                    data=[0.0] * shift + list(sequence.logprobs), dtype="float32"
                ),
                "advantages": types.TensorData(
                    data=[0.0] * shift + [reward - mean] * len(sequence.tokens), dtype="float32"
                ),
            }
            model_input = types.ModelInput.from_ints(tokens[:-1])
            data.append(types.Datum(model_input=model_input, loss_fn_inputs=inputs))
        self._wait(trainer.forward_backward(data, "importance_sampling"))
        self._wait(trainer.optim_step(types.AdamParams(learning_rate=1e-4)))


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


def soak(args: argparse.Namespace) -> tuple[list[tuple[float, float]], list[Client], int]:
    """(curve of (mean steps done, RSS MB), the clients, 5xx answers in the server's log)."""
    keys = [f"tml-soak-{i}" for i in range(args.clients)]
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "server.log"
        server, url = start_server(args.model, keys, Path(scratch) / "run", log)
        try:
            clients = [Client(url, key, args.model, args) for key in keys]
            for client in clients:
                client.start()
            curve = []
            while any(c.is_alive() for c in clients):
                done = statistics.fmean(c.steps_done for c in clients)
                curve.append((done, _rss_mb(server.pid)))
                time.sleep(0.5)
            curve.append((statistics.fmean(c.steps_done for c in clients), _rss_mb(server.pid)))
        finally:
            server.terminate()
            server.wait(timeout=60)
        lines = log.read_text().splitlines()
    errors = sum(1 for line in lines if " 500 " in line or "Traceback" in line)
    return curve, clients, errors


def report(args: argparse.Namespace, curve, clients: list[Client], server_errors: int) -> None:
    console = Console(width=120)
    warm = max(1, args.steps // 10)
    memory = Table(title=f"server memory, {args.clients} clients x {args.steps} steps")
    memory.add_column("mean steps done", justify="right")
    memory.add_column("RSS MB", justify="right")
    wanted = [warm + (args.steps - warm) * i / max(1, args.points - 1) for i in range(args.points)]
    for target in wanted:
        done, rss = next(((d, r) for d, r in curve if d >= target), curve[-1])
        memory.add_row(f"{done:.1f}", f"{rss:.0f}")
    after_warm = [r for d, r in curve if d >= warm] or [curve[-1][1]]
    memory.add_row("growth after warm-up", f"{after_warm[-1] - after_warm[0]:+.0f}")
    console.print(memory)
    waits = Table(title="wait per request (s)")
    for column in ("client", "requests", "p50", "p99", "max", "steps"):
        waits.add_column(column, justify="right")
    for i, client in enumerate(clients):
        waits.add_row(
            str(i),
            str(len(client.waits)),
            f"{_percentile(client.waits, 0.5):.3f}",
            f"{_percentile(client.waits, 0.99):.3f}",
            f"{max(client.waits, default=float('nan')):.3f}",
            str(client.steps_done),
        )
    console.print(waits)
    failures = [f for c in clients for f in c.failures]
    fivexx = sum(1 for f in failures if "InternalServerError" in f or "server" in f.lower())
    console.print(f"5xx answers: {fivexx + server_errors}")
    console.print(f"failed clients: {len(failures)}")
    for failure in failures:
        console.print(f"  {failure}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--group", type=int, default=4, help="samples per step")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--points", type=int, default=10, help="rows of the memory curve")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    curve, clients, server_errors = soak(args)
    report(args, curve, clients, server_errors)
    if any(c.failures for c in clients):
        sys.exit(1)


if __name__ == "__main__":
    main()
