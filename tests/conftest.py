"""Shared fixtures: a fresh staging root per test (so tests can check it is left empty) and
helpers to build and compare state dicts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# DataLoader workers are forked and import numpy.random on start; if another thread of this process
# (a transfer pool, a server fixture) holds the import lock at the fork, the child's import fails
# (KeyError in importlib's module lock: one flaky CI run). Imported here, the child finds it loaded.
import numpy.random  # noqa: F401
import pytest
import torch
import torch.distributed as dist

from uc_checkpoint.errors import rank_error

pytest_plugins = ["tests.support.s3_fixtures", "tests.support.mlflow_server"]

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


class HeldInWriteStep:
    """A state-dict value whose serialisation (in the save's write step) sets ``reached`` and then
    waits for ``release``: holds one save there while a test runs another (threads of one process)."""

    def __init__(self, reached: threading.Event, release: threading.Event) -> None:
        self.reached, self.release = reached, release

    def __getstate__(self) -> dict:
        self.reached.set()
        assert self.release.wait(60), "the test never released the held save"
        return {}

    def __setstate__(self, state: dict) -> None:
        self.reached = self.release = threading.Event()


def wait_for(cond: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``cond`` every 10 ms until it is true or ``timeout`` seconds have passed (a guard
    against a hang, not a measure of speed); returns its last value as a bool."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


@pytest.fixture(autouse=True)
def _fresh_s3_clients() -> Iterator[None]:
    """Each test starts with no shared boto3 client (uc_checkpoint.volumes.s3_client.CLIENTS): tests hook
    events onto their volume's client, which must not reach the next test's volumes."""
    from uc_checkpoint.volumes.s3_client import CLIENTS

    CLIENTS.clear()
    yield
    CLIENTS.clear()


@pytest.fixture
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A staging root used through ``UC_CHECKPOINT_STAGING_DIR``."""
    root = tmp_path / "staging"
    root.mkdir()
    monkeypatch.setenv("UC_CHECKPOINT_STAGING_DIR", str(root))
    return root


def staging_files(root: Path) -> list[Path]:
    """Files left anywhere under a staging root."""
    return [p for p in root.rglob("*") if p.is_file()]


def make_state_dict(seed: int = 0, n: int = 4, rows: int = 256) -> dict:
    """Tensors of several dtypes and shapes plus plain Python objects."""
    g = torch.Generator().manual_seed(seed)
    sd: dict = {f"w{i}": torch.randn(rows * (i + 1), 64, generator=g) for i in range(n)}
    sd["ids"] = torch.randint(0, 1000, (333,), generator=g)
    sd["half"] = torch.randn(17, 5, generator=g).to(torch.bfloat16)
    sd["extra"] = {"step": seed, "name": f"run-{seed}", "lr": [0.1, 0.01]}
    return sd


def empty_like_state_dict(sd: dict) -> dict:
    """A template of the same structure with zeroed tensors and blank objects."""
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def assert_state_dict_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def causes(exc: BaseException) -> list[BaseException]:
    """The exception, DCP's per-rank failures and their causes, flattened."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        out.append(e)
        for failure in getattr(e, "failures", {}).values():
            # DCP stores (exception, traceback summary) per rank.
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        if e.__cause__ is not None:
            todo.append(e.__cause__)
    return out


def cause(exc_info: pytest.ExceptionInfo[BaseException]) -> BaseException:
    """The single rank's own error inside DCP's ``CheckpointException`` (``errors.rank_error``),
    checking that exactly rank 0 failed."""
    assert list(getattr(exc_info.value, "failures", {0: None})) == [0]
    return rank_error(exc_info.value)


def run_script(args: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a Python script or torchrun from the venv with the repo importable; fail on timeout."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def torchrun(
    script: Path, *args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return run_script([exe, "--standalone", f"--nproc_per_node={nproc}", str(script), *args], timeout=timeout, env=env)


def assert_ranks_ok(proc: subprocess.CompletedProcess, ranks: int, modes: Iterable[str]) -> None:
    """The torchrun job exited 0 and every rank printed ``RANK <r> <mode> OK`` for every mode (its
    output's tail in the message otherwise)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for mode in modes:
        for rank in range(ranks):
            assert f"RANK {rank} {mode} OK" in proc.stdout, out[-6000:]


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh root path in fsspec's in-process memory filesystem (``memory://<root>/...``),
    removed afterwards."""
    import uuid

    import fsspec

    root = f"/uc-test-{uuid.uuid4().hex[:12]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real 1-rank gloo process group in this process (FileStore), destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
