"""The benchmark mounts (benchmarks/mounts.py): s3fs over moto and bindfs come up, carry
bytes both ways, and are gone after the context exits. Needs root, /dev/fuse, s3fs and bindfs
(skipped with the reason otherwise; ``./scripts/bench.sh`` installs the tools, the tests do not)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from benchmarks.mounts import bindfs_mount, fuse_problem, s3fs_mount
from benchmarks.servers import make_bucket
from tests.support.s3_fixtures import moto_server, s3_client

pytestmark = [
    pytest.mark.skipif(fuse_problem() is not None, reason=f"no FUSE mounts here: {fuse_problem()}"),
    pytest.mark.timeout(120),
]

SIZE = 3 << 20


def payload() -> bytes:
    # Not compressible and not repeating, so a short or misplaced write cannot pass.
    return os.urandom(SIZE)


def mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return any(line.split(" ")[1] == real for line in f)


def test_s3fs_mount_roundtrip(tmp_path: Path) -> None:
    data = payload()
    mnt = tmp_path / "s3"
    with moto_server() as url:
        bucket = make_bucket(url, f"uc-mnt-{uuid.uuid4().hex[:12]}")
        with s3fs_mount(url, bucket, mnt) as root:
            assert root == mnt
            assert os.path.ismount(mnt)
            with open(root / "ckpt.bin", "wb") as f:
                f.write(data)
            # s3fs uploads on close, so the object must be there now, byte for byte.
            obj = s3_client(url).get_object(Bucket=bucket, Key="ckpt.bin")
            assert obj["ContentLength"] == SIZE
            assert obj["Body"].read() == data
            assert (root / "ckpt.bin").read_bytes() == data
        assert not os.path.ismount(mnt)
        assert not mounted(mnt)
        # The object outlives the mount.
        assert s3_client(url).head_object(Bucket=bucket, Key="ckpt.bin")["ContentLength"] == SIZE


def test_s3fs_mount_cleaned_up_when_body_raises(tmp_path: Path) -> None:
    mnt = tmp_path / "s3"
    with moto_server() as url:
        bucket = make_bucket(url, f"uc-mnt-{uuid.uuid4().hex[:12]}")
        with pytest.raises(KeyError):
            with s3fs_mount(url, bucket, mnt):
                assert mounted(mnt)
                raise KeyError("boom")
        assert not mounted(mnt)


def test_s3fs_mount_missing_bucket_fails_clearly(tmp_path: Path) -> None:
    mnt = tmp_path / "s3"
    with moto_server() as url:
        with pytest.raises(RuntimeError, match="s3fs"):
            with s3fs_mount(url, "no-such-bucket", mnt):
                pass
        assert not mounted(mnt)


def test_bindfs_mount_roundtrip(tmp_path: Path) -> None:
    data = payload()
    src, mnt = tmp_path / "src", tmp_path / "bind"
    src.mkdir()
    with bindfs_mount(src, mnt) as root:
        assert root == mnt
        assert os.path.ismount(mnt)
        with open(root / "ckpt.bin", "wb") as f:
            f.write(data)
        assert (src / "ckpt.bin").read_bytes() == data
        assert (root / "ckpt.bin").read_bytes() == data
    assert not os.path.ismount(mnt)
    assert not mounted(mnt)
    assert (src / "ckpt.bin").read_bytes() == data


def test_bindfs_mount_cleaned_up_with_file_left_open(tmp_path: Path) -> None:
    # fusermount3 -u fails with EBUSY while a file is open; the lazy fallback must still
    # leave no mount and no daemon behind.
    src, mnt = tmp_path / "src", tmp_path / "bind"
    src.mkdir()
    with bindfs_mount(src, mnt) as root:
        held = open(root / "held.bin", "wb")
    try:
        assert not mounted(mnt)
    finally:
        try:
            held.close()
        except OSError:
            pass  # ENOTCONN: the daemon behind it is gone
