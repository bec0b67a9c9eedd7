"""Staging directories in one process: the per-user private root and what it refuses, the owner's
record and lock, and the reclaim of staging whose owner is dead (a dead owner is a record of another
pid on this host whose lock nobody holds; a live one is the same with the lock held on another open
file, as another process would hold it). The real SIGKILLed processes and a second user are in
tests/integration/test_staging_reclaim.py."""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest

from uc_checkpoint.engine.staging_dir import (
    LOCK_SUFFIX,
    OWNER_SUFFIX,
    STAGING_ENV,
    OwnerRecord,
    create_staging_dir,
    default_staging_root,
    reclaim_dead_staging,
    staging_dir_for,
    user_staging_base,
)
from uc_checkpoint.errors import StagingError
from uc_checkpoint.ops.garbage import collect_garbage

UID = os.geteuid()


def sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def left_by(base: Path, name: str, record: OwnerRecord | None, nbytes: int = 1000) -> Path:
    """A staging directory as a process described by ``record`` left it (no record: None)."""
    path = base / name
    path.mkdir(parents=True)
    (path / "__0_t_0.distcp").write_bytes(b"x" * nbytes)
    if record is not None:
        sibling(path, OWNER_SUFFIX).write_text(record.to_json())
        sibling(path, LOCK_SUFFIX).touch()
    return path


def other_process(**changes: object) -> OwnerRecord:
    """A record of another process on this host (pid numbers matter only without locks)."""
    return dataclasses.replace(OwnerRecord.of_this_process(), pid=os.getpid() + 1, **changes)  # type: ignore[arg-type]


def test_layout_private_base_owner_files_and_removal(tmp_path: Path) -> None:
    path = staging_dir_for(tmp_path, "save", "file:///ckpt/step_1", "0123456789abcdef", 3)
    assert path.parent == tmp_path / f"uc-checkpoint-{UID}" == user_staging_base(tmp_path)
    assert path.name.startswith("save-") and path.name.endswith("-0123456789ab-rank-3")
    held = create_staging_dir(path)
    assert held.path == path and path.is_dir()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.stat().st_uid == UID
    record = OwnerRecord.read(sibling(path, OWNER_SUFFIX))
    assert record is not None and record.is_process(OwnerRecord.of_this_process()) and record.locked
    (path / "f").write_bytes(b"abc")
    held.remove()
    assert list(path.parent.iterdir()) == []  # the directory, its record and its lock
    held.remove()  # a second call does nothing


def test_the_default_root_is_the_setting_else_the_temp_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(STAGING_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert default_staging_root() == tmp_path / "tmp"
    assert user_staging_base(None) == tmp_path / "tmp" / f"uc-checkpoint-{UID}"
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "nvme"))
    assert staging_dir_for(None, "load", "s3://b/k", "id", 0).parent == tmp_path / "nvme" / f"uc-checkpoint-{UID}"


def assert_refused(path: Path, *why: str) -> None:
    with pytest.raises(StagingError) as err:
        create_staging_dir(path)
    text = str(err.value)
    assert f"cannot create staging directory {path}" in text and all(w in text for w in why), text
    assert STAGING_ENV in text and "staging_dir=" in text, text  # the setting that moves staging
    assert not path.exists()


@pytest.mark.skipif(UID != 0, reason="needs root, to make a directory owned by another user")
def test_a_base_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    base = user_staging_base(tmp_path)
    base.mkdir(mode=0o700)
    os.chown(base, 65534, 65534)
    assert_refused(base / "save-x-rank-0", f"{base} belongs to uid 65534, not to this user (uid {UID})")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_base_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    base = user_staging_base(tmp_path)
    base.mkdir()
    base.chmod(mode)
    assert_refused(base / "save-x-rank-0", f"{base} is writable by other users (mode {mode:04o})")


def test_a_symlinked_base_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    base = user_staging_base(tmp_path)
    base.symlink_to(target)
    assert_refused(base / "save-x-rank-0", f"{base} is a symbolic link")
    assert list(target.iterdir()) == []


def test_a_base_of_ours_that_others_may_only_read_is_used(tmp_path: Path) -> None:
    base = user_staging_base(tmp_path)
    base.mkdir()
    base.chmod(0o755)
    create_staging_dir(base / "load-x-rank-0").remove()
    assert stat.S_IMODE(base.stat().st_mode) == 0o755


def test_a_root_that_is_a_file_names_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_refused(staging_dir_for(blocker, "save", "u", "id", 0), f"{blocker} cannot be a directory")
    assert_refused(staging_dir_for(blocker / "deeper", "save", "u", "id", 0), "or a folder above it, is a file")


def test_a_dead_owners_staging_is_reclaimed_by_the_next_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="uc_checkpoint.engine.staging_dir")
    base = user_staging_base(tmp_path)
    base.mkdir(mode=0o700)
    dead = left_by(base, "save-aaa-bbb-rank-0", other_process(), nbytes=1234)
    held = create_staging_dir(base / "save-ccc-ddd-rank-0")
    assert sorted(p.name for p in base.iterdir()) == [held.path.name + s for s in ("", LOCK_SUFFIX, OWNER_SUFFIX)]
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"reclaimed staging directory {dead} of process {os.getpid() + 1}" in line and "(1234 bytes)" in line
    held.remove()


def test_a_live_owners_staging_is_kept_until_it_dies(tmp_path: Path) -> None:
    base = user_staging_base(tmp_path)
    base.mkdir(mode=0o700)
    live = left_by(base, "save-aaa-bbb-rank-0", other_process())
    fd = os.open(sibling(live, LOCK_SUFFIX), os.O_RDWR)  # its lock, held as its owner holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert reclaim_dead_staging(base) == []
        create_staging_dir(base / "save-ccc-ddd-rank-0").remove()
        assert (live / "__0_t_0.distcp").read_bytes() == b"x" * 1000
    finally:
        os.close(fd)  # the owner dies: the kernel releases its lock
    (gone,) = reclaim_dead_staging(base)
    assert gone.path == live and gone.bytes == 1000 and not live.exists()
    assert not sibling(live, OWNER_SUFFIX).exists() and not sibling(live, LOCK_SUFFIX).exists()


def test_this_processs_own_staging_is_never_reclaimed(tmp_path: Path) -> None:
    # A load starting while this process's async save uploads: same host, same pid.
    first = create_staging_dir(staging_dir_for(tmp_path, "save", "u", "save-1", 0))
    (first.path / "f").write_bytes(b"s")
    second = create_staging_dir(staging_dir_for(tmp_path, "load", "u", "load-1", 0))
    assert (first.path / "f").read_bytes() == b"s" and reclaim_dead_staging(first.path.parent) == []
    second.remove()
    first.remove()


def test_records_that_prove_nothing_are_kept(tmp_path: Path) -> None:
    base = user_staging_base(tmp_path)
    base.mkdir(mode=0o700)
    kept = [
        left_by(base, "save-none-rank-0", None),  # no record (written by nothing we know)
        left_by(base, "save-host-rank-0", other_process(host="another-host")),  # another host's
    ]
    partial = left_by(base, "save-partial-rank-0", other_process())
    sibling(partial, OWNER_SUFFIX).write_text(other_process().to_json()[:20])  # cut mid-write
    kept.append(partial)
    assert reclaim_dead_staging(base) == []
    assert all(p.is_dir() for p in kept)


def test_without_locks_pid_and_start_time_decide() -> None:
    me = OwnerRecord.of_this_process(locked=False)
    if me.boot is None or me.start is None or me.pid_ns is None:
        pytest.skip("no /proc here")
    assert not me.proves_dead(me)  # this very process
    assert dataclasses.replace(me, start=me.start + 1).proves_dead(me)  # its pid, reused by another
    assert dataclasses.replace(me, boot="another-boot").proves_dead(me)  # a reboot ended it
    assert not dataclasses.replace(me, pid_ns="pid:[1]", start=me.start + 1).proves_dead(me)  # not our pids
    assert not dataclasses.replace(me, boot=None).proves_dead(me)


def test_without_locks_a_reused_pid_is_reclaimed_and_a_live_one_kept(tmp_path: Path) -> None:
    me = OwnerRecord.of_this_process(locked=False)
    if me.start is None:
        pytest.skip("no /proc here")
    base = user_staging_base(tmp_path)
    base.mkdir(mode=0o700)
    # pid 1 lives in every namespace; a record of it with another start time is a reused pid.
    reused = left_by(base, "save-reused-rank-0", dataclasses.replace(me, pid=1, start=-1))
    alive = left_by(base, "save-alive-rank-0", dataclasses.replace(me, pid=1, start=None))
    assert [r.path for r in reclaim_dead_staging(base)] == [reused]
    assert alive.is_dir() and not reused.exists()


def test_gc_reclaims_dead_staging_at_once_keeps_live_and_ages_the_rest(tmp_path: Path) -> None:
    root, staging = tmp_path / "run", tmp_path / "staging"
    root.mkdir()
    base = user_staging_base(staging)
    base.mkdir(parents=True, mode=0o700)
    live = create_staging_dir(base / "save-live-rank-0")  # this process's: old files, kept anyway
    dead = left_by(base, "save-dead-rank-0", other_process())  # fresh files: no grace needed
    unknown = left_by(base, "save-unknown-rank-0", None)  # no record: by age, as before
    day_ago = time.time() - 86400
    for p in (live.path, unknown, unknown / "__0_t_0.distcp"):
        os.utime(p, (day_ago, day_ago))

    dry = collect_garbage(str(root), grace_s=3600, staging_dir=staging, dry_run=True)
    assert sorted(dry.removed_staging_dirs) == sorted([str(dead), str(unknown)])
    assert dead.is_dir() and unknown.is_dir()
    report = collect_garbage(str(root), grace_s=0, staging_dir=staging)
    assert sorted(report.removed_staging_dirs) == sorted([str(dead), str(unknown)])
    assert not dead.exists() and not unknown.exists() and live.path.is_dir()
    assert sorted(p.name for p in base.iterdir()) == [live.path.name + s for s in ("", LOCK_SUFFIX, OWNER_SUFFIX)]
    live.remove()
