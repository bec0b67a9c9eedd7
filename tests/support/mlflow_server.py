"""A real ``mlflow server`` for tests: SQLite backend and artifacts in a temporary directory, on a
free port of 127.0.0.1, one per test module (fixture ``mlflow_server``, its URL). Registered in
tests/conftest.py's ``pytest_plugins``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Seconds the server may take to answer its first request (it runs its database migrations first).
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of an ``mlflow server`` of this module's own, stopped at the end."""
    base = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    exe = Path(sys.executable).parent / "mlflow"
    cmd = [
        str(exe),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{base / 'mlflow.db'}",
        "--artifacts-destination",
        str(base / "artifacts"),
    ]
    log = (base / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=base)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}: {(base / 'server.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not answer in {START_TIMEOUT_S} s: {(base / 'server.log').read_text()}"
                )
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its workers: the session started above
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
