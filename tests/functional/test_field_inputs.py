"""Inputs from the field (issue 14): data files that grew or never end are refused before they are
read, and the package exports the names users reach for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import REPO
from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import ReaderOptions, Staging
from uc_checkpoint.errors import CorruptCheckpointError, rank_error


def _sd() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(1000)}


def _load_error(location: str | Path, *, prefetch: bool = True, **kwargs: object) -> BaseException:
    target = {"a": torch.zeros(300_000), "b": torch.zeros(1000)}
    with pytest.raises(BaseException) as info:
        dcp.load(
            target,
            storage_reader=UCVolumeReader(location, **kwargs, options=ReaderOptions(prefetch_files=prefetch)),
            no_dist=True,
        )
    return rank_error(info.value)


def _data_file(location: Path) -> Path:
    return sorted(location.glob("*.distcp"))[0]


def _staged_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_a_data_file_grown_to_a_sparse_gigabyte_is_refused_before_reading(tmp_path: Path, staging: Path) -> None:
    loc = tmp_path / "ckpt"
    sd = _sd()
    dcp.save(sd, storage_writer=UCVolumeWriter(loc), no_dist=True)
    victim = _data_file(loc)
    recorded = victim.stat().st_size
    os.truncate(victim, 1 << 30)
    err = _load_error(loc, prefetch=True)
    assert isinstance(err, CorruptCheckpointError), err
    assert f"{victim} has {1 << 30} bytes, the checkpoint recorded {recorded}" in str(err), err
    assert _staged_bytes(staging) < (1 << 20)  # nothing of the gigabyte reached staging
    # Ranged reads refuse it as well (the file's size is checked at each read: fstat), though the
    # recorded ranges themselves still hold the saved bytes.
    err = _load_error(loc, prefetch=False)
    assert isinstance(err, CorruptCheckpointError), err
    assert f"{victim} has {1 << 30} bytes, the checkpoint recorded {recorded}" in str(err), err


@pytest.mark.parametrize("change", ["appended", "truncated"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_data_file_of_another_size_is_refused_by_every_load(
    tmp_path: Path, staging: Path, change: str, prefetch: bool
) -> None:
    # A few bytes appended past every item: no item's range reads them, yet the file is not the
    # one saved. Cut short: its last item's range is missing bytes.
    loc = tmp_path / "ckpt"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(loc), no_dist=True)
    victim = _data_file(loc)
    recorded = victim.stat().st_size
    if change == "appended":
        with open(victim, "ab") as f:
            f.write(b"tail")
    else:
        os.truncate(victim, recorded - 4)
    err = _load_error(loc, prefetch=prefetch)
    assert isinstance(err, CorruptCheckpointError), err
    assert victim.name in str(err), err
    if change == "appended" or prefetch:
        assert (
            f"has {recorded + 4 if change == 'appended' else recorded - 4} bytes, the checkpoint recorded {recorded}"
            in str(err)
        ), err


def test_a_data_file_that_is_a_symlink_to_dev_zero_is_refused(tmp_path: Path, staging: Path) -> None:
    loc = tmp_path / "ckpt"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(loc), no_dist=True)
    victim = _data_file(loc)
    victim.unlink()
    victim.symlink_to("/dev/zero")
    for prefetch in (True, False):
        err = _load_error(loc, prefetch=prefetch)
        assert isinstance(err, CorruptCheckpointError) and victim.name in str(err), err
        assert "not a regular file" in str(err), err


def test_a_metadata_that_never_ends_is_refused(tmp_path: Path) -> None:
    loc = tmp_path / "ckpt"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(loc), no_dist=True)
    (loc / ".metadata").unlink()
    (loc / ".metadata").symlink_to("/dev/zero")
    err = _load_error(loc)
    assert isinstance(err, CorruptCheckpointError) and ".metadata" in str(err) and "not a regular file" in str(err)


def test_a_stock_checkpoint_file_that_grew_is_read_only_as_far_as_its_items(tmp_path: Path, staging: Path) -> None:
    # Stock FileSystemWriter checkpoints carry no manifest: only the bytes the items need are read.
    loc = tmp_path / "stock"
    sd = _sd()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(loc)), no_dist=True)
    victim = _data_file(loc)
    os.truncate(victim, 1 << 30)
    target = {"a": torch.zeros(300_000), "b": torch.zeros(1000)}
    dcp.load(target, storage_reader=UCVolumeReader(loc, options=ReaderOptions(prefetch_files=True)), no_dist=True)
    assert torch.equal(target["a"], sd["a"]) and torch.equal(target["b"], sd["b"])


def test_an_fsspec_data_file_that_grew_is_refused() -> None:
    import fsspec

    url = "memory://field-inputs/grown"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(url), no_dist=True)
    fs = fsspec.filesystem("memory")
    victim = next(p for p in fs.ls("/field-inputs/grown", detail=False) if p.endswith(".distcp"))
    fs.pipe_file(victim, fs.cat_file(victim) + b"\0" * (8 << 20))
    try:
        err = _load_error(url, prefetch=True)
        assert isinstance(err, CorruptCheckpointError) and victim.rsplit("/", 1)[-1] in str(err), err
        assert "the checkpoint recorded" in str(err)
    finally:
        fs.rm("/field-inputs", recursive=True)


def test_an_s3_data_file_that_grew_is_refused(s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.s3_fixtures import s3_client

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    url = f"s3://{s3_bucket}/grown"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(url), no_dist=True)
    client = s3_client(s3_server)
    key = next(
        o["Key"]
        for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="grown/")["Contents"]
        if o["Key"].endswith(".distcp")
    )
    body = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    for tail in (b"\0" * (4 << 20), b"x"):  # grown far, or by one byte no item's range reaches
        client.put_object(Bucket=s3_bucket, Key=key, Body=body + tail)
        for prefetch in (True, False):  # whole files, or ranged GETs (their Content-Range gives the size)
            err = _load_error(url, prefetch=prefetch)
            assert isinstance(err, CorruptCheckpointError) and key.rsplit("/", 1)[-1] in str(err), err
            assert f"has {len(body) + len(tail)} bytes, the checkpoint recorded {len(body)}" in str(err), err


def test_the_package_exports_the_names_users_reach_for() -> None:
    # A fresh interpreter: the names resolve lazily, and importing the package costs no torch import.
    code = (
        "import sys, uc_checkpoint\n"
        "assert 'torch' not in sys.modules\n"
        "from uc_checkpoint import (CheckpointManager, DataTracker, ShardSpec, TrackedDataLoader,\n"
        "    TrackedShardDataset, TrackerStateful, collect_garbage, GCReport, list_root, describe_checkpoint,\n"
        "    verify_checkpoint, UCVolumeWriter, UCVolumeReader, S3Volume, LocalVolume, FsspecVolume, open_volume,\n"
        "    VolumeError, DataLoadingError)\n"
        "from uc_checkpoint.ops.manager import CheckpointManager as M\n"
        "assert CheckpointManager is M\n"
        "missing = [n for n in uc_checkpoint.__all__ if not hasattr(uc_checkpoint, n)]\n"
        "assert not missing, missing\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# One canonical form of a location


def _spellings(kind: str, base: str) -> list[str]:
    """Spellings of the location ``<base>/run1/step_00000005`` for one volume kind."""
    if kind == "local":
        return [
            f"{base}/run1/step_00000005",
            f"{base}/run1/step_00000005/",
            f"{base}//run1///step_00000005",
            f"{base}/run1/./step_00000005",
            f"file://{base}/run1/step_00000005/",
            f"file://localhost{base}/run1//step_00000005",
        ]
    return [
        f"{base}/run1/step_00000005",
        f"{base}/run1/step_00000005/",
        f"{base}/run1//step_00000005",
        f"{base}//run1/step_00000005//",
    ]


def _roots(kind: str, base: str) -> list[str]:
    return [f"{base}/run1", f"{base}/run1/", f"{base}//run1//"]


@pytest.fixture(params=["local", "s3", "memory"])
def location_base(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    kind = request.param
    if kind == "local":
        return kind, str(tmp_path)
    if kind == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        request.getfixturevalue("monkeypatch").setenv("AWS_ENDPOINT_URL", server)
        return kind, f"s3://{bucket}"
    return kind, f"memory://canon-{tmp_path.name}"


def test_every_spelling_of_a_location_finds_the_same_checkpoint(location_base: tuple[str, str]) -> None:
    from uc_checkpoint import CheckpointManager, list_root
    from uc_checkpoint.volumes import open_volume

    kind, base = location_base
    spellings = _spellings(kind, base)
    assert len({open_volume(s).url for s in spellings}) == 1, [open_volume(s).url for s in spellings]
    for n, writer_spelling in enumerate(spellings[:3]):
        sd = {"w": torch.full((16,), float(n))}
        dcp.save(sd, storage_writer=UCVolumeWriter(writer_spelling), no_dist=True)
        for reader_spelling in spellings:
            target = {"w": torch.zeros(16)}
            dcp.load(target, storage_reader=UCVolumeReader(reader_spelling), no_dist=True)
            assert torch.equal(target["w"], sd["w"]), (writer_spelling, reader_spelling)
    for root in _roots(kind, base):
        assert CheckpointManager(root).latest() == 5, root
        assert [s.step for s in list_root(root)] == [5], root
    # A manager root with a trailing slash saves where every other spelling finds it.
    manager = CheckpointManager(_roots(kind, base)[1], staging=Staging(mode="sync"))
    manager.save(7, {"w": torch.full((16,), 7.0)})
    target = {"w": torch.zeros(16)}
    dcp.load(target, storage_reader=UCVolumeReader(f"{base}/run1/step_00000007"), no_dist=True)
    assert torch.equal(target["w"], torch.full((16,), 7.0))


@pytest.mark.parametrize(
    ("location", "words"),
    [
        ("", "empty checkpoint location"),
        ("   ", "empty checkpoint location"),
        ("s3://ab/run", "'ab'"),
        ("s3://My-Bucket/run", "upper-case"),
        ("s3://my_bucket/run", "'my_bucket'"),
        ("s3://a" + "b" * 63 + "/run", "characters"),
        ("s3://bucket/run/../other", "'..'"),
        ("memory://run/./x", "'.'"),
        ("file://otherhost/run", "'otherhost'"),
    ],
)
def test_ambiguous_or_invalid_locations_are_refused_at_once(location: str, words: str) -> None:
    from uc_checkpoint import CheckpointManager, VolumeError

    for make in (UCVolumeWriter, UCVolumeReader, CheckpointManager):
        with pytest.raises(VolumeError) as info:
            make(location)
        assert words in str(info.value), (make, info.value)


def test_the_cli_refuses_an_invalid_bucket_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "uc_checkpoint.cli", "ls", "s3://ab/run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2 and "invalid S3 bucket name 'ab'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("victim", ["data", "metadata", "directory"])
def test_a_fifo_or_directory_in_a_checkpoint_is_refused_without_blocking(tmp_path: Path, victim: str) -> None:
    from uc_checkpoint import CheckpointManager, list_root

    loc = tmp_path / "root" / "step_00000001"
    dcp.save(_sd(), storage_writer=UCVolumeWriter(loc), no_dist=True)
    path = loc / ".metadata" if victim == "metadata" else _data_file(loc)
    path.unlink()
    if victim == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)  # opening it for reading would block until a writer came
    for prefetch in (True, False):
        err = _load_error(loc, prefetch=prefetch)
        assert isinstance(err, CorruptCheckpointError) and "not a regular file" in str(err), err
    assert CheckpointManager(str(tmp_path / "root")).latest() is None
    assert [s.state for s in list_root(str(tmp_path / "root"))] == ["broken"]


def test_the_short_file_url_form_is_a_path(tmp_path: Path) -> None:
    from uc_checkpoint.volumes import open_volume

    assert open_volume(f"file:{tmp_path}/x").url == str(tmp_path / "x")
    dcp.save(_sd(), storage_writer=UCVolumeWriter(f"file:{tmp_path}/ck"), no_dist=True)
    assert (tmp_path / "ck" / ".metadata").is_file()


@pytest.mark.parametrize("bucket", ["xn--abc", "sthree-abc", "abc-s3alias", "abc--ol-s3"])
def test_reserved_bucket_names_are_refused(bucket: str) -> None:
    from uc_checkpoint import VolumeError

    with pytest.raises(VolumeError, match="reserves"):
        UCVolumeWriter(f"s3://{bucket}/run")


@pytest.mark.parametrize("value", ["False", 0, 1, "no"])
def test_the_checksums_option_takes_only_booleans(value: object) -> None:
    from uc_checkpoint import VolumeError

    with pytest.raises(VolumeError, match="checksums must be True, False or None"):
        UCVolumeWriter("s3://bucket/run", volume_options={"checksums": value})
