"""Staging on shared hosts and small disks, with real processes (tests/scripts/staging_job.py):

* a save SIGKILLed mid-upload (held there by tests/scripts/upload_hold) leaves its staged files;
  the next load and save on the host reclaim them, and log the bytes;
* the same on a 40 MiB staging disk, where the leftovers would make the next saves fail as full
  (a tmpfs: needs root);
* a live save held mid-upload beside two saves starting at once, both reclaiming a dead one's
  staging: the dead one's goes exactly once, the live one's is untouched and its save completes;
* a second user (uid 65534, a child forked from the test process) on a host where root saved and
  loaded with the default staging: it saves, and loads root's checkpoint, with its own private
  staging root; an ``uc-checkpoint-<uid>`` planted by someone else is refused with a message naming
  the setting, which then works (needs root, to be two users).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import REPO, SCRIPTS, causes, wait_for
from tests.support.tmpfs import mounted_tmpfs
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.engine.staging_dir import OWNER_SUFFIX, OwnerRecord, tree_bytes

SCRIPT = SCRIPTS / "staging_job.py"
HOLD_HOOK = SCRIPTS / "upload_hold"
MIB = 1 << 20
NOBODY = 65534

pytestmark = pytest.mark.slow


def state(mib: int, seed: int) -> dict:
    """What tests/scripts/staging_job.py saves for ``mib`` and ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * (1 << 18), generator=g), "meta": {"seed": seed}}


def job_env(staging: Path | None, hold_dir: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "UC_CHECKPOINT_STAGING_DIR"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    if staging is not None:
        env["UC_CHECKPOINT_STAGING_DIR"] = str(staging)
    if hold_dir is not None:  # uploads into locations named "held-..." wait while hold_dir/hold exists
        env.update(
            PYTHONPATH=f"{HOLD_HOOK}{os.pathsep}{REPO}",
            UC_TEST_HOLD_UPLOAD="held-",
            UC_TEST_HOLD_DIR=str(hold_dir),
            UC_TEST_HOLD_MAX_S="120",
        )
    env.update(extra)
    return env


def start(op: str, dest: Path, mib: int, seed: int, env: dict[str, str], **popen) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(SCRIPT), op, str(dest), str(mib), str(seed)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"staging_job.py hung:\n{out}") from None
    return out


def staged_by(staging: Path, pid: int) -> int:
    """Bytes staged under ``staging`` by the process ``pid`` (by the owner records)."""
    base = user_base(staging)
    return sum(
        tree_bytes(p)
        for p in (base.iterdir() if base.is_dir() else ())
        if (r := OwnerRecord.read(p.with_name(p.name + OWNER_SUFFIX))) is not None and r.pid == pid
    )


def held_save(dest: Path, mib: int, seed: int, staging: Path, hold_dir: Path) -> subprocess.Popen[str]:
    """A save whose uploads are held once its whole share is staged (its small items' file, then
    the one with the tensor: the single upload worker is held on the first, the second waits)."""
    hold_dir.mkdir(exist_ok=True)
    (hold_dir / "hold").touch()
    proc = start("save", dest, mib, seed, job_env(staging, hold_dir))
    started = hold_dir / f"upload-started-{proc.pid}"
    if not wait_for(lambda: started.exists() and staged_by(staging, proc.pid) >= mib * MIB or proc.poll(), 120):
        proc.kill()
        raise AssertionError(f"the held save never staged its share:\n{proc.communicate()[0]}")
    assert proc.poll() is None, proc.communicate()[0]
    return proc


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def leftovers(base: Path) -> dict[Path, int]:
    """Staging directories under ``base`` with their bytes."""
    return {p: tree_bytes(p) for p in base.iterdir() if p.is_dir()} if base.is_dir() else {}


def user_base(root: Path, uid: int | None = None) -> Path:
    return root / f"uc-checkpoint-{os.geteuid() if uid is None else uid}"


def load_equals(dest: Path, want: dict) -> bool:
    got = {"w": torch.zeros_like(want["w"]), "meta": {"seed": -1}}
    dcp.load(got, storage_reader=UCVolumeReader(dest), no_dist=True)
    return torch.equal(got["w"], want["w"]) and got["meta"] == want["meta"]


def reclaim_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "reclaimed staging directory" in line]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs (root only)."""
    with mounted_tmpfs(tmp_path / "small", "40m") as mnt:
        yield mnt


def test_a_killed_saves_staging_is_reclaimed_by_the_next_load_and_save(
    tmp_path: Path, staging: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="uc_checkpoint.engine.staging_dir")
    good = tmp_path / "vol" / "good"
    dcp.save(state(1, 5), storage_writer=UCVolumeWriter(good), no_dist=True)
    killed = held_save(tmp_path / "vol" / "held-1", 8, 6, staging, tmp_path / "hold")
    pid = killed.pid
    sigkill(killed)
    base = user_base(staging)
    (left, nbytes), *more = leftovers(base).items()
    assert not more and nbytes >= 8 * MIB, leftovers(base)  # the killed save's whole share
    record = OwnerRecord.read(left.with_name(left.name + OWNER_SUFFIX))
    assert record is not None and record.pid == pid and record.locked

    assert load_equals(good, state(1, 5))  # a load on this host: it stages, so it reclaims first
    assert not left.exists() and leftovers(base) == {}
    assert not [p for p in base.iterdir()], list(base.iterdir())  # its .owner and .lock went too
    (line,) = [r.getMessage() for r in caplog.records if "reclaimed staging directory" in r.getMessage()]
    assert f"{left} of process {pid}" in line and f"({nbytes} bytes)" in line, line

    dcp.save(state(1, 7), storage_writer=UCVolumeWriter(tmp_path / "vol" / "next"), no_dist=True)
    assert load_equals(tmp_path / "vol" / "next", state(1, 7)) and leftovers(base) == {}


def test_on_a_40_mib_staging_disk_the_relaunched_job_saves_again(
    tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="uc_checkpoint.engine.staging_dir")
    killed = held_save(tmp_path / "vol" / "held-step-1", 24, 1, small_disk, tmp_path / "hold")
    sigkill(killed)
    assert sum(leftovers(user_base(small_disk)).values()) >= 24 * MIB
    assert shutil.disk_usage(small_disk).free < 24 * MIB  # without the reclaim the next save cannot fit

    monkeypatch.setenv("UC_CHECKPOINT_STAGING_DIR", str(small_disk))
    for step in (2, 3):  # the relaunched job's saves
        dest = tmp_path / "vol" / f"step-{step}"
        dcp.save(state(24, step), storage_writer=UCVolumeWriter(dest, sync_files=False), no_dist=True)
        assert load_equals(dest, state(24, step))
    assert leftovers(user_base(small_disk)) == {} and not list(small_disk.rglob("*.distcp"))
    (line,) = [r.getMessage() for r in caplog.records if "reclaimed staging directory" in r.getMessage()]
    assert f"of process {killed.pid}" in line


def test_a_live_save_beside_two_reclaiming_saves(tmp_path: Path, staging: Path) -> None:
    hold_dir, vol = tmp_path / "hold", tmp_path / "vol"
    live = held_save(vol / "held-live", 4, 2, staging, hold_dir)
    (live_dir,) = leftovers(user_base(staging))
    live_files = {p.name: p.stat().st_size for p in live_dir.iterdir()}
    assert sum(live_files.values()) >= 4 * MIB
    dead = held_save(vol / "held-dead", 4, 1, staging, hold_dir)  # its own reclaim spares the live one
    sigkill(dead)
    (dead_dir,) = set(leftovers(user_base(staging))) - {live_dir}

    # Two saves start at once; both reclaim before they stage.
    savers = [start("save", vol / f"free-{i}", 2, 10 + i, job_env(staging)) for i in (1, 2)]
    outs = [finish(p) for p in savers]
    assert [p.returncode for p in savers] == [0, 0], outs
    lines = reclaim_lines("".join(outs))
    assert len(lines) == 1 and f"{dead_dir} of process {dead.pid}" in lines[0], outs
    assert not dead_dir.exists()
    assert live.poll() is None and {p.name: p.stat().st_size for p in live_dir.iterdir()} == live_files

    (hold_dir / "hold").unlink()  # the live save's upload goes on
    out = finish(live)
    assert live.returncode == 0 and "OK save" in out, out
    assert not live_dir.exists() and leftovers(user_base(staging)) == {}
    assert load_equals(vol / "held-live", state(4, 2))
    for i in (1, 2):
        assert load_equals(vol / f"free-{i}", state(2, 10 + i))


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A shared temp dir (mode 1777, like /tmp) that this process and uid 65534 both use as the
    temp dir, with no ``UC_CHECKPOINT_STAGING_DIR``; root only."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to be a second user (uid 65534)")
    shared = Path(tempfile.mkdtemp(prefix="uc-shared-tmp-", dir="/tmp"))
    shared.chmod(0o1777)
    monkeypatch.delenv("UC_CHECKPOINT_STAGING_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    try:
        yield shared
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _as_nobody(conn: Connection, op: str, dest: Path, seed: int, staging_env: str | None) -> None:
    """In a forked child: become uid/gid 65534, then save or load as staging_job.py does."""
    try:
        torch.set_num_threads(1)  # the parent's intra-op threads are not in this child
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        if staging_env is not None:
            os.environ["UC_CHECKPOINT_STAGING_DIR"] = staging_env
        if op == "save":
            dcp.save(state(2, seed), storage_writer=UCVolumeWriter(dest), no_dist=True)
        elif not load_equals(dest, state(2, seed)):
            raise AssertionError(f"{dest} does not hold the state of seed {seed}")
        conn.send(f"OK {op}")
    except BaseException as exc:  # noqa: BLE001  (DCP's CheckpointException is one)
        conn.send("\n".join(f"FAILED {type(e).__name__}: {e}" for e in causes(exc)))


def as_nobody(op: str, dest: Path, seed: int, staging_env: str | None = None) -> str:
    """Run a save or load of a 2 MiB state as uid 65534, in a child forked from this process (it
    imports nothing new: the interpreter's own files may not be readable by that user)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_as_nobody, args=(child, op, dest, seed, staging_env), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(120), "the second user's process hung"
        return str(parent.recv())
    finally:
        proc.join(30)


def test_a_second_user_saves_and_loads_with_its_own_private_staging(shared_tmp: Path) -> None:
    ckpt_a = shared_tmp / "ckpt-a"
    dcp.save(state(2, 1), storage_writer=UCVolumeWriter(ckpt_a), no_dist=True)  # root, default staging
    assert load_equals(ckpt_a, state(2, 1))
    base_a = user_base(shared_tmp, 0)
    assert stat.S_IMODE(base_a.stat().st_mode) == 0o700 and base_a.stat().st_uid == 0

    # Someone else got there first: uid 65534's staging root exists but is not its own.
    planted = user_base(shared_tmp, NOBODY)
    planted.mkdir(mode=0o755)
    out = as_nobody("save", shared_tmp / "ckpt-b", 2)
    assert "FAILED StagingError" in out and f"{planted} belongs to uid 0" in out, out
    assert "UC_CHECKPOINT_STAGING_DIR" in out and "staging_dir=" in out, out
    own = shared_tmp / "nobody-staging"  # what the message says to do works
    own.mkdir()
    os.chown(own, NOBODY, NOBODY)
    assert as_nobody("save", shared_tmp / "ckpt-b", 2, staging_env=str(own)) == "OK save"
    planted.rmdir()

    assert as_nobody("save", shared_tmp / "ckpt-b2", 3) == "OK save"
    assert as_nobody("load", ckpt_a, 1) == "OK load"  # root's readable checkpoint
    base_b = user_base(shared_tmp, NOBODY)
    assert stat.S_IMODE(base_b.stat().st_mode) == 0o700 and base_b.stat().st_uid == NOBODY
    assert leftovers(base_b) == {} and leftovers(base_a) == {}
    assert load_equals(shared_tmp / "ckpt-b2", state(2, 3))  # and root reads what it wrote

    # Root again, after the other user: its own staging root is still its own and private.
    dcp.save(state(2, 4), storage_writer=UCVolumeWriter(shared_tmp / "ckpt-a2"), no_dist=True)
    assert load_equals(shared_tmp / "ckpt-a2", state(2, 4))
