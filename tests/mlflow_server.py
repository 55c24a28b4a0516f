"""A real `mlflow server` for tests: one worker on a free local port, in its own process
group so that stopping it also stops uvicorn's worker. The conftest fixture `mlflow_server`
serves a fresh store; the browser test serves the comparison's."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

SERVER_START_S = 120  # it imports all of MLflow twice (CLI, then uvicorn's worker): 56 s seen under load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM, then SIGKILL, to the process group the test started (the server's uvicorn child,
    Chromium's renderer and GPU processes)."""
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


@contextlib.contextmanager
def mlflow_server(store_uri: str, workdir: Path) -> Iterator[str]:
    """`mlflow server` on `store_uri`, its artifacts and log under `workdir`; its address."""
    port = free_port()
    log = workdir / "mlflow-server.log"
    # The job runner is a second process importing MLflow; no test needs it.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", store_uri,
             "--artifacts-destination", str(workdir / "mlartifacts"), "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited {server.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{address}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {SERVER_START_S} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield address
    finally:
        stop_group(server)
