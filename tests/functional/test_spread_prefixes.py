"""Data files spread over key prefixes (``spread_prefixes``) in one process: the names, the checks
of ``.metadata``, and every tool that lists or deletes a checkpoint's files (publish, retention,
``ls``, ``verify``, ``gc``, the reader) on a local directory, on S3 (moto over HTTP) and in memory.
A one-rank save puts its files in ``0/``; the four-rank case is tests/integration/test_spread_prefixes.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.support.s3_fixtures import FaultProxy, s3_client
from uc_checkpoint import CheckpointManager, UCVolumeReader, UCVolumeWriter, collect_garbage, list_root
from uc_checkpoint.dcp.metadata_io import bad_file_name
from uc_checkpoint.dcp.options import ReaderOptions, Staging, WriterOptions
from uc_checkpoint.engine import publish
from uc_checkpoint.engine.listing import checkpoint_entries, checkpoint_files
from uc_checkpoint.errors import LocationNotEmptyError
from uc_checkpoint.format import layout
from uc_checkpoint.ops.summary import describe_checkpoint
from uc_checkpoint.ops.verify import verify_checkpoint
from uc_checkpoint.volumes import MemoryVolume, S3Volume

SPREAD = WriterOptions(spread_prefixes=16, file_size_bytes=1024)


def state(step: int) -> dict:
    return {f"t{i}": torch.full((300,), float(step * 10 + i)) for i in range(4)} | {"meta": {"step": step}}


def blank() -> dict:
    return {f"t{i}": torch.zeros(300) for i in range(4)} | {"meta": {"step": None}}


def data_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.distcp"))


# ---- names -------------------------------------------------------------------------------------


def test_spread_names_and_counts() -> None:
    assert [layout.spread_dir(r, 1) for r in (0, 7)] == ["", ""]
    assert [layout.spread_dir(r, 4) for r in (0, 5, 7)] == ["0", "1", "3"]
    assert [layout.spread_dir(r, 16) for r in (15, 17)] == ["f", "1"]
    assert [layout.spread_dir(r, 32) for r in (1, 31, 33)] == ["01", "1f", "01"]  # one width per save
    assert layout.spread_dir(300, 256) == "2c"
    assert layout.data_file_prefix(5, "abcd1234", "1") == "1/__5_abcd1234_"
    # Automatic: flat below 256 ranks and off S3; one prefix per 32 ranks, at most 256.
    assert layout.spread_count(None, 255, partitioned_store=True) == 1
    assert layout.spread_count(None, 256, partitioned_store=True) == 8
    assert layout.spread_count(None, 1000, partitioned_store=True) == 32
    assert layout.spread_count(None, 100_000, partitioned_store=True) == 256
    assert layout.spread_count(None, 100_000, partitioned_store=False) == 1
    assert layout.spread_count(4, 2, partitioned_store=False) == 4  # explicit: any store, any size
    for bad in (0, 257):
        with pytest.raises(ValueError, match="spread_prefixes"):
            layout.spread_count(bad, 8, partitioned_store=True)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("3a/__5_abcd1234_0.distcp", True),
        ("0/__0_abcd1234_12.distcp", True),
        ("__0_abcd1234_0.distcp", True),
        ("3a/../x.distcp", False),
        ("3A/__0.distcp", False),  # upper case: never written
        ("zz/__0.distcp", False),
        ("100/__0.distcp", False),  # three digits: more than 256 prefixes
        ("3a/b/__0.distcp", False),
        ("3a/.metadata", False),
        ("/3a/__0.distcp", False),
        ("3a/", False),
        ("3a/c:__0.distcp", False),
    ],
)
def test_only_data_files_of_a_spread_prefix_may_hold_a_slash(name: str, ok: bool) -> None:
    assert (bad_file_name(name) is None) is ok, bad_file_name(name)
    if "/" in name and ":" not in name:  # what a location may hold (a ':' is refused only in .metadata)
        assert layout.is_checkpoint_file(name) is ok


def test_the_option_is_checked_where_it_is_given(tmp_path: Path) -> None:
    assert WriterOptions().spread_prefixes is None
    assert WriterOptions(spread_prefixes=256).spread_prefixes == 256
    for bad, error in ((0, ValueError), (257, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match="spread_prefixes"):
            WriterOptions(spread_prefixes=bad)
        with pytest.raises(error, match="spread_prefixes"):
            UCVolumeWriter(tmp_path, options=WriterOptions(spread_prefixes=bad))


def test_listing_includes_spread_prefixes_and_keeps_other_sub_locations() -> None:
    volume = MemoryVolume("ckpt")
    volume.prepare_for_write()
    for name in (".metadata", "0/__0_t_0.distcp", "0/__2_t_0.distcp", "1f/__31_t_0.distcp", "other/x"):
        with volume.open_write(name) as f:
            f.write(b"abc")
    entries = {e.name: e.size for e in checkpoint_entries(volume)}
    assert entries == {
        ".metadata": 3,
        "0/__0_t_0.distcp": 3,
        "0/__2_t_0.distcp": 3,
        "1f/__31_t_0.distcp": 3,
        "other/": -1,
    }
    # A save may start at a location with spread prefixes, but not beside a foreign directory.
    with pytest.raises(LocationNotEmptyError, match="other/"):
        publish.begin_save(volume, publish.SaveMarker(None, "abcd1234"), "id", overwrite=True, create_parents=True)
    volume.delete("other/x")
    volume.child("other").remove_if_empty()
    publish.begin_save(volume, publish.SaveMarker(None, "abcd1234"), "id", overwrite=True, create_parents=True)


# ---- a local directory -------------------------------------------------------------------------


def test_local_spread_checkpoint_loads_with_the_stock_reader_and_every_tool_sees_its_files(
    tmp_path: Path, staging: Path
) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(root, keep_last=1, staging=Staging(mode="sync"), writer=SPREAD)
    manager.save(1, state(1))
    step1 = root / "step_00000001"
    assert [p.split("/")[0] for p in data_files(step1)] == ["0"] * 4  # rank 0 -> "0/", one file per tensor
    assert sorted(os.listdir(step1)) == [".metadata", ".uc-claim", "0"]

    stock = blank()
    dcp.load(stock, storage_reader=FileSystemReader(step1))
    assert torch.equal(stock["t3"], state(1)["t3"]) and stock["meta"] == {"step": 1}
    for prefetch in (True, False):  # whole files into staging sub-directories, and ranges
        ours = blank()
        dcp.load(ours, storage_reader=UCVolumeReader(step1, options=ReaderOptions(prefetch_files=prefetch)))
        assert torch.equal(ours["t2"], state(1)["t2"])
    report = verify_checkpoint(str(step1))
    assert report.ok and report.files_checked == report.files_checksummed == 4, report
    files = describe_checkpoint(str(step1), data_state=False)["files"]
    assert list(files) == ["0"] and [f["name"].split("/")[0] for f in files["0"]] == ["0"] * 4  # by rank
    (summary,) = list_root(str(root))
    on_disk = sum(
        p.stat().st_size for p in step1.rglob("*") if p.is_file() and p.name != ".uc-claim"
    )  # the checkpoint's own
    assert (summary.state, summary.files, summary.bytes) == ("complete", 4, on_disk)

    # Retention deletes the old checkpoint whole, its spread prefix included.
    manager.save(2, state(2))
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    # A second save at one location removes the files it supersedes from the spread prefix.
    step2 = root / "step_00000002"
    before = data_files(step2)
    dcp.save(state(3), storage_writer=UCVolumeWriter(step2, options=SPREAD))
    after = data_files(step2)
    assert len(after) == 4 and not set(before) & set(after)

    # A missing file in a spread prefix is damage, found by verify, ls and latest().
    (step2 / after[0]).unlink()
    assert any(after[0] in p for p in verify_checkpoint(str(step2)).problems)
    assert list_root(str(root))[0].state == "broken"
    assert CheckpointManager(root, staging=Staging(mode="sync")).latest() is None


def test_gc_collects_an_unpublished_spread_location(tmp_path: Path, staging: Path) -> None:
    root = tmp_path / "run"
    CheckpointManager(root, keep_last=None, staging=Staging(mode="sync"), writer=SPREAD).save(5, state(5))
    location = root / "step_00000005"
    (location / ".metadata").unlink()  # as a save killed before publishing leaves it
    old = time.time() - 3600
    for path in location.rglob("*"):
        os.utime(path, (old, old))
    report = collect_garbage(str(root), grace_s=60, include_staging=False)
    # the four data files, and the killed save's claim with its location
    assert (
        sorted(f.rsplit("/step_00000005/", 1)[1].split("/")[0] for f in report.deleted_files)
        == [".uc-claim"] + ["0"] * 4
    )
    assert not location.exists()  # the spread prefix, then the location, removed once empty


def test_fsspec_spread_checkpoint_loads_with_the_stock_fsspec_reader(staging: Path) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"memory://spread-{time.time_ns()}/ckpt"
    dcp.save(
        state(7), storage_writer=UCVolumeWriter(url, options=WriterOptions(spread_prefixes=4, file_size_bytes=1024))
    )
    stock = blank()
    dcp.load(stock, storage_reader=FsspecReader(url))
    assert torch.equal(stock["t0"], state(7)["t0"]) and stock["meta"] == {"step": 7}
    for prefetch in (True, False):
        ours = blank()
        dcp.load(ours, storage_reader=UCVolumeReader(url, options=ReaderOptions(prefetch_files=prefetch)))
        assert torch.equal(ours["t3"], state(7)["t3"])
    assert verify_checkpoint(url).files_checksummed == 4


# ---- S3 ----------------------------------------------------------------------------------------


def test_s3_spread_checkpoint_retention_gc_and_request_counts(
    s3_bucket: str, fault_proxy: FaultProxy, staging: Path
) -> None:
    root = S3Volume(f"s3://{s3_bucket}/run", endpoint_url=fault_proxy.url)
    client = s3_client(fault_proxy.url)

    def keys(prefix: str = "run/") -> list[str]:
        return sorted(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix).get("Contents", []))

    manager = CheckpointManager(root, keep_last=1, staging=Staging(mode="sync"), writer=SPREAD)
    manager.save(1, state(1))
    assert [k for k in keys() if k.endswith(".distcp")] == [k for k in keys("run/step_00000001/0/")]
    for prefetch in (True, False):
        back = blank()
        dcp.load(
            back,
            storage_reader=UCVolumeReader(root.child("step_00000001"), options=ReaderOptions(prefetch_files=prefetch)),
        )
        assert torch.equal(back["t1"], state(1)["t1"])

    fault_proxy.reset()
    (summary,) = list_root(root)
    assert (summary.state, summary.files) == ("complete", 4)
    lists = [r for r in fault_proxy.history if r.method == "GET" and "list-type=2" in r.path]
    assert len(lists) == 1  # the root's recursive listing: the location and its spread prefix too

    manager.save(2, state(2))  # retention deletes step 1, spread prefix included
    assert not keys("run/step_00000001/")
    assert verify_checkpoint(root.child("step_00000002")).ok

    # gc: a killed save's files in a spread prefix, and its multipart upload there (but not one of
    # a location below: that is another location's).
    client.put_object(Bucket=s3_bucket, Key="run/step_00000003/0/__0_abcd1234_0.distcp", Body=b"x" * 10)
    client.create_multipart_upload(Bucket=s3_bucket, Key="run/step_00000003/0/__0_abcd1234_1.distcp")
    client.create_multipart_upload(Bucket=s3_bucket, Key="run/step_00000003/deeper/x/y.distcp")
    report = collect_garbage(root, grace_s=0, include_staging=False)
    assert report.deleted_files == [f"s3://{s3_bucket}/run/step_00000003/0/__0_abcd1234_0.distcp"]
    assert report.aborted_uploads == 1
    left = [u["Key"] for u in client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])]
    assert left == ["run/step_00000003/deeper/x/y.distcp"]
    found = checkpoint_files(root.child("step_00000002"))
    assert sorted(f"run/step_00000002/{name}" for name in found) == keys("run/step_00000002/")
