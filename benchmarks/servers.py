"""The S3 servers the benchmarks run against, each a process of its own on 127.0.0.1 and a free port
(so that its CPU and memory are apart from the client's and can be read on its pid).

* :func:`moto_process`: moto's server (objects in memory, those over 5 MiB in temporary files).
* :func:`localbucket_process`: ``localbucket`` (PyPI, in the ``bench`` extra: one file, no
  dependencies, its buckets directories on disk), a second store, so that the store's limits can be
  told apart from the clients' costs.
* :func:`localbucket_available`, :func:`make_bucket`, :func:`free_port`.

moto inside this process (its threads: the runner's own CPU is then the store's) is the tests'
:func:`tests.support.s3_fixtures.moto_server`, which ``benchmarks.run`` uses from there: the tests
must not depend on ``benchmarks/``, and the benchmarks already use the tests' fault proxy and S3
client, so the one in-process starter stays with the tests and the process starters live here.

Each server process asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``),
so even a runner killed with SIGKILL leaves no server behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from tests.support.s3_fixtures import s3_client

log = logging.getLogger(__name__)

#: Seconds a server gets to answer after it is started, and to exit after SIGTERM (then SIGKILL).
SERVER_TIMEOUT_S = 60.0
#: The fake credentials and region every client of these servers uses (neither server checks them).
FAKE_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

# The first lines of every server process: SIGTERM when the parent dies (prctl option 1).
_ORPHAN_GUARD = "import ctypes, signal, sys\nctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
_MOTO_MAIN = _ORPHAN_GUARD + "from moto.server import main\nmain(sys.argv[1:])\n"
# localbucket writes an answer's headers and its body in two writes on a socket with Nagle's
# algorithm on: a small body then waits for the ACK of the headers, which the client delays by its
# delayed-ACK timer, so every small GET and every listing would take that timer's time. An S3
# server does not make a client wait for it, so its connections get TCP_NODELAY (socketserver's
# ``disable_nagle_algorithm``), as any server of small answers has.
_LOCALBUCKET_MAIN = (
    _ORPHAN_GUARD + "import localbucket\n"
    "localbucket.S3Handler.disable_nagle_algorithm = True\n"
    "sys.argv = ['localbucket', *sys.argv[1:]]\n"
    "localbucket.main()\n"
)
# Environment of a localbucket process: the machine's AWS_* and *_CA_BUNDLE settings have no
# business in a server.
_LOCALBUCKET_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ")
_LOG_TAIL_CHARS = 4000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it before the
    caller binds it; the starters below retry on "Address already in use")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_bucket(endpoint_url: str, name: str) -> str:
    """Create bucket ``name`` on the S3 endpoint ``endpoint_url`` (path-style, us-east-1, the fake
    ``testing`` keys) and return ``name``.

    Raises:
        botocore.exceptions.ClientError: the endpoint refused (e.g. an invalid bucket name).
        botocore.exceptions.EndpointConnectionError: nothing listens at ``endpoint_url``.
    """
    s3_client(endpoint_url).create_bucket(Bucket=name)
    return name


@contextlib.contextmanager
def moto_process(work: Path) -> Iterator[tuple[str, int]]:
    """moto's S3 server in a process of its own; yields ``(url, pid)``. Its log is
    ``work/moto-<port>.log``; it is stopped when the body ends, however it ends.

    Raises:
        RuntimeError: the server exited or did not answer within :data:`SERVER_TIMEOUT_S` (the
            message carries the tail of its log).
    """

    def start(port: int) -> tuple[list[str], Path]:
        return [_MOTO_MAIN, "-H", "127.0.0.1", "-p", str(port)], work / f"moto-{port}.log"

    with _server("moto", start, {**os.environ, **FAKE_ENV}) as served:
        yield served


@contextlib.contextmanager
def localbucket_process(data_root: Path) -> Iterator[tuple[str, int]]:
    """``localbucket`` serving its buckets as directories under ``data_root`` (created if missing);
    yields ``(url, pid)``. Its request log goes to ``data_root``'s sibling ``localbucket.log``. It is
    stopped when the body ends, however it ends; the caller removes ``data_root``. Credentials are
    not checked; requests must be path-style.

    Raises:
        RuntimeError: the server exited or did not answer within :data:`SERVER_TIMEOUT_S` (the
            message carries the tail of its log).
    """
    data_root.mkdir(parents=True, exist_ok=True)

    def start(port: int) -> tuple[list[str], Path]:
        return [_LOCALBUCKET_MAIN, str(data_root), "--port", str(port)], data_root.parent / "localbucket.log"

    env = {k: v for k, v in os.environ.items() if k in _LOCALBUCKET_ENV_KEEP}
    with _server("localbucket", start, env) as served:
        yield served


def localbucket_available() -> str | None:
    """None when ``localbucket`` imports in this interpreter's environment, else why not (for the
    log). Asked of a child interpreter, so that this process does not import it."""
    proc = subprocess.run(
        [sys.executable, "-c", "import localbucket; print(localbucket.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {proc.returncode}"
    return None


@contextlib.contextmanager
def _server(name: str, start, env: Mapping[str, str]) -> Iterator[tuple[str, int]]:
    """Run ``python -c`` with the arguments ``start(port)`` gives (with its log file) on a free port
    until it accepts connections; yield ``(url, pid)``; stop it on exit."""
    for _attempt in range(3):  # the free port may be taken between the probe and the bind
        port = free_port()
        args, logfile = start(port)
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        if _listening(proc, port):
            break
        _stop(proc)
        if "Address already in use" not in _tail(logfile):
            raise RuntimeError(f"{name} did not start on port {port}:\n{_tail(logfile)}")
    else:
        raise RuntimeError(f"{name} found no free port:\n{_tail(logfile)}")
    url = f"http://127.0.0.1:{port}"
    log.info("%s (pid %d) serving at %s", name, proc.pid, url)
    try:
        yield url, proc.pid
    finally:
        _stop(proc)


def _listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(SERVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    except OSError as exc:
        return f"(unreadable: {exc})"
