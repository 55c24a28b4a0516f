"""Benchmark: `mlflow models serve` of an exported model under load, on loopback.

Usage (from the repository root):
    python -m benchmarks.serving_bench --model out/ml100k/model --prepared out/ml100k/prepared \
        [--clients 8] [--seconds 60] [--repeats 1] [--output docs/results/serving_bench.md]

``--model`` is a `freescale export` folder (saved here as an MLflow pyfunc model, with the signature and
input example export logs) or an MLflow model folder. The server is MLflow's own (``--env-manager local``,
one worker, this interpreter). Each request is one user's whole history from ``--prepared`` (raw item ids,
timestamps and ratings; the users in turn), ``params: {"k": 10}``. ``--clients`` threads send requests back
to back on kept-alive connections for ``--seconds``; the table gives requests/s, the median and 99th
percentile latency, and failed requests (any answer but 200, or no answer), the median over
``--repeats``. The clients share the machine with the server: on 2 cores they take CPU from it.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from benchmarks.common import REPO, commit

SERVER_START_S = 180  # it imports mlflow, torch and the model; 60 s seen on a loaded 2-core machine
DEFAULT_K = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pyfunc_model(model: Path, workdir: Path) -> Path:
    """An MLflow model folder: ``model`` itself when it is one (it has an MLmodel file), else the export
    folder saved as the pyfunc model `freescale export` logs."""
    if (model / "MLmodel").is_file():
        return model
    import mlflow

    from freescale.training.export.exporter import pyfunc_arguments, quiet_mlflow

    target = workdir / "pyfunc"
    shutil.rmtree(target, ignore_errors=True)
    with quiet_mlflow():
        mlflow.pyfunc.save_model(str(target), **pyfunc_arguments(model))
    return target


@contextlib.contextmanager
def serve_model(model: Path, log: Path, workers: int = 1) -> Iterator[str]:
    """`mlflow models serve --env-manager local` of the MLflow model folder ``model`` on a free loopback
    port, in its own process group, its output to ``log``; its address once /ping answers."""
    port = free_port()
    # The project on the path (the model's code imports freescale.model); this environment's
    # scripts on PATH (mlflow execs `uvicorn`); one torch thread per worker, as the ranks run.
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join(filter(None, [bin_dir, os.environ.get("PATH")])),
           "OMP_NUM_THREADS": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    cmd = [str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", str(model), "--env-manager", "local",
           "-h", "127.0.0.1", "-p", str(port), "-w", str(workers)]
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, cwd=log.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, port, log)
        yield address
    finally:
        stop_group(server)


def wait_ready(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow models serve exited {server.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"mlflow models serve not ready after {SERVER_START_S} s: {log.read_text()[-2000:]}")
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM, then SIGKILL, to the server's process group (uvicorn's worker with it)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def invoke(address: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """One POST /invocations: the status and the decoded JSON answer."""
    host, port = address.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", "/invocations", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def history_bodies(prepared: Path, k: int = DEFAULT_K) -> list[bytes]:
    """One request body per user of a prepare output: the whole history as raw ids, times and ratings."""
    import pyarrow.parquet as pq

    vocab = pq.read_table(prepared / "item_vocab", columns=["raw_item", "item_id"]).to_pydict()
    raw = dict(zip(vocab["item_id"], vocab["raw_item"]))
    rows = pq.read_table(prepared / "sequences").to_pylist()
    bodies = []
    for row in rows:
        items = row["items"] + [row["valid_item"], row["test_item"]]
        times = row["timestamps"] + [row["valid_timestamp"], row["test_timestamp"]]
        ratings = [int(r or 0) for r in row["ratings"] + [row["valid_rating"], None]]
        record = {"items": [raw[i] for i in items], "timestamps": times, "ratings": ratings}
        bodies.append(json.dumps({"dataframe_records": [record], "params": {"k": k}}).encode())
    return bodies


@dataclass
class Load:
    """What the clients saw: every successful request's latency (s), the failures, the wall time."""

    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self) -> dict[str, float]:
        ordered = sorted(self.latencies) or [float("nan")]
        return {"requests": len(self.latencies) + len(self.errors),
                "requests_per_s": (len(self.latencies) + len(self.errors)) / self.seconds,
                "p50_ms": 1000 * ordered[len(ordered) // 2],
                "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                "errors": len(self.errors)}


def drive(address: str, bodies: list[bytes], clients: int, seconds: float) -> Load:
    """``clients`` threads POST ``bodies`` in turn, back to back, for ``seconds``; bounded in count and time."""
    host, port = address.removeprefix("http://").split(":")
    load, lock, turn = Load(), threading.Lock(), iter(range(10**12))
    deadline = time.monotonic() + seconds

    def client() -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        while time.monotonic() < deadline:
            with lock:
                body = bodies[next(turn) % len(bodies)]
            started = time.perf_counter()
            try:
                connection.request("POST", "/invocations", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                answer = response.read()
                failed = None if response.status == 200 else f"HTTP {response.status}: {answer[:200]!r}"
            except (OSError, http.client.HTTPException) as exc:
                failed = f"{type(exc).__name__}: {exc}"
                connection.close()
                connection = http.client.HTTPConnection(host, int(port), timeout=60)
            with lock:
                (load.errors.append(failed) if failed else load.latencies.append(time.perf_counter() - started))
        connection.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    load.seconds = time.monotonic() - started
    return load


def table(rows: list[dict[str, float]], args: argparse.Namespace) -> str:
    """The markdown table: the median of each column over the repeats, and every repeat."""
    head = "| clients | seconds | requests | requests/s | p50 ms | p99 ms | failed |\n| --- | --- | --- | --- | --- | --- | --- |\n"

    def line(name: str, r: dict[str, float]) -> str:
        return (f"| {args.clients} | {args.seconds:g} ({name}) | {r['requests']:.0f} | {r['requests_per_s']:.1f} | "
                f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']:.0f} |\n")
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    return head + line("median", median) + "".join(line(f"repeat {i + 1}", r) for i, r in enumerate(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="a freescale export folder or an MLflow model folder")
    p.add_argument("--prepared", required=True, type=Path, help="the prepare output the requests' histories come from")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=Path("out/serving_bench"))
    p.add_argument("--output", type=Path, help="also write the markdown here")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    bodies = history_bodies(args.prepared)
    with serve_model(pyfunc_model(args.model.resolve(), args.workdir.resolve()),
                     args.workdir.resolve() / "server.log") as address:
        drive(address, bodies[:50], 1, 5)  # warm-up: the first requests load lazily
        rows = [drive(address, bodies, args.clients, args.seconds) for _ in range(args.repeats)]
    text = (f"`{' '.join(['python -m benchmarks.serving_bench', *(argv if argv is not None else sys.argv[1:])])}`, "
            f"commit {commit()}, {platform.node()} ({os.cpu_count()} CPUs), {len(bodies)} histories\n\n"
            + table([r.row() for r in rows], args))
    print(text)
    if args.output:
        args.output.write_text(text)
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
