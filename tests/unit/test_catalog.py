"""The catalog of checkpoints under a root (uc_checkpoint.ops.catalog): one record per step location
in one of four states, one ``latest()`` shared by the manager, ``ls`` and the demo, and store
errors that stay errors."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from uc_checkpoint.dcp.metadata_io import manifest_of, read_metadata
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.engine.listing import checkpoint_entries, locations_below
from uc_checkpoint.errors import TransferError
from uc_checkpoint.format.layout import ABANDONED_NAME, METADATA_NAME, checkpoint_name, is_claim
from uc_checkpoint.ops import catalog
from uc_checkpoint.ops import catalog as checkpoints
from uc_checkpoint.ops.catalog import inspect_step, latest, list_steps, scan
from uc_checkpoint.ops.lineage import abandonment_marker
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.summary import list_root
from uc_checkpoint.volumes import FsspecVolume, LocalVolume, Volume


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "meta": {"step": step}}


def data_files(location: Volume) -> list[str]:
    return sorted(n for n in location.list_files() if n.endswith(".distcp"))


def make_root(kind: str, tmp_path: Path) -> Volume:
    if kind == "local":
        return LocalVolume(tmp_path / "root")
    return FsspecVolume(f"memory://catalog-{tmp_path.name}")


def abandon(location: Volume) -> None:
    save_id = (manifest_of(read_metadata(location)) or {}).get("save_id")
    location.publish_bytes(ABANDONED_NAME, abandonment_marker(save_id, 1, None), overwrite=True)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path: Path, staging: Path) -> Volume:
    """Steps 1 complete, 2 abandoned, 3 with a data file deleted, 4 with a garbage .metadata, 5
    unpublished (a data file only)."""
    volume = make_root(request.param, tmp_path)
    manager = CheckpointManager(volume, keep_last=None, write_pointer=False, staging=Staging(mode="sync"))
    for step in (1, 2, 3, 4):
        manager.save(step, state(step))
    abandon(volume.child(checkpoint_name(2)))
    broken = volume.child(checkpoint_name(3))
    broken.delete(data_files(broken)[0])
    volume.child(checkpoint_name(4)).publish_bytes(METADATA_NAME, b"not a pickle", overwrite=True)
    unpublished = volume.child(checkpoint_name(5))
    unpublished.prepare_for_write()
    unpublished.publish_bytes("__0_0123abcd_0.distcp", b"x" * 11, overwrite=True)
    return volume


def test_every_state_and_the_latest(root: Volume) -> None:
    listed = list_steps(root)
    assert [(i.step, i.name, i.published, i.state) for i in listed] == [
        (1, "step_00000001", True, None),
        (2, "step_00000002", True, None),
        (3, "step_00000003", True, None),
        (4, "step_00000004", True, None),
        (5, "step_00000005", False, "incomplete"),
    ]
    rows = {i.step: i for i in scan(root)}
    assert {s: r.state for s, r in rows.items()} == {
        1: "complete",
        2: "abandoned",
        3: "broken",
        4: "broken",
        5: "incomplete",
    }
    assert rows[1].problem is None and rows[1].abandoned is False
    assert rows[2].problem is not None and "abandoned by a rollback" in rows[2].problem and rows[2].abandoned
    assert rows[3].problem is not None and "is missing" in rows[3].problem
    assert rows[4].problem is not None and "corrupt or truncated" in rows[4].problem
    assert rows[5].problem is None and rows[5].bytes == 11 and rows[5].files == 1
    one = root.child(checkpoint_name(1))
    # the checkpoint is what its .metadata needs: the location's claim is not counted
    assert rows[1].bytes == sum(s for n, s in one.list_files().items() if s >= 0 and not is_claim(n)) > 0
    assert rows[1].files == len(data_files(one)) > 0
    found = latest(root)
    assert found is not None and (found.step, found.state) == (1, "complete")
    weak = latest(root, intact=False)
    assert weak is not None and weak.step == 4 and weak.state is None  # newest published, nothing read
    assert not hasattr(checkpoints, "latest_checkpoint") and not hasattr(checkpoints, "list_checkpoints")


def test_how_much_ls_checks(root: Volume) -> None:
    """``scan``'s ``check``: every published checkpoint (``all``), newest first until one is complete
    (``latest``: here every one, since only the oldest is intact), or none (the listing only)."""
    now = time.time()
    checked = {i.step: i for i in scan(root, check="all", now=now)}
    assert {s: r.state for s, r in checked.items()} == {
        1: "complete",
        2: "abandoned",
        3: "broken",
        4: "broken",
        5: "incomplete",
    }
    assert scan(root, check="latest", now=now) == list(checked.values())
    listed = {i.step: i for i in scan(root, check="none", now=now)}
    assert {s: (r.published, r.state) for s, r in listed.items()} == {
        1: (True, None),
        2: (True, None),
        3: (True, None),
        4: (True, None),
        5: (False, "incomplete"),
    }
    # Without the .metadata nothing tells a checkpoint's own files from others': every file a save
    # writes is counted (the claim is the location's, not the checkpoint's). Step 1 holds only its own.
    assert (listed[1].bytes, listed[1].files) == (checked[1].bytes, checked[1].files)
    assert listed[1].unreferenced_files is None and checked[1].unreferenced_files == 0
    assert listed[5] == checked[5]
    assert [(s.step, s.state) for s in list_root(root, check="none")] == [
        (1, "published"),
        (2, "published"),
        (3, "published"),
        (4, "published"),
        (5, "incomplete"),
    ]
    with pytest.raises(ValueError, match="check must be one of none, latest, all"):
        scan(root, check="some")


def test_ls_checks_the_newest_until_one_is_complete(tmp_path: Path, staging: Path, monkeypatch) -> None:
    volume = LocalVolume(tmp_path / "root")
    manager = CheckpointManager(volume, keep_last=None, write_pointer=False, staging=Staging(mode="sync"))
    for step in (1, 2, 3, 4):
        manager.save(step, state(step))
    broken = volume.child(checkpoint_name(4))
    broken.delete(data_files(broken)[0])
    reads: list[str] = []
    original = LocalVolume.read_bytes

    def counted(self, name):
        reads.append(f"{self.url.rsplit('/', 1)[-1]}/{name}")
        return original(self, name)

    monkeypatch.setattr(LocalVolume, "read_bytes", counted)
    rows = [(i.step, i.state) for i in scan(volume)]
    monkeypatch.undo()
    assert rows == [(1, None), (2, None), (3, "complete"), (4, "broken")]
    assert reads == [f"step_00000004/{METADATA_NAME}", f"step_00000003/{METADATA_NAME}"]  # not 2's, not 1's
    assert manager.latest() == 3


def test_the_manager_and_ls_agree_with_the_catalog(root: Volume, caplog) -> None:
    manager = CheckpointManager(root, keep_last=None, staging=Staging(mode="sync"))
    with caplog.at_level(logging.INFO):
        assert manager.latest() == 1
    assert "step_00000004" in caplog.text and "step_00000003" in caplog.text
    assert manager._view.abandoned == {2}
    assert [(i.step, i.published) for i in manager.list()] == [(1, True), (2, True), (3, True), (4, True), (5, False)]
    summary = list_root(root)
    assert [(s.step, s.state) for s in summary] == [(i.step, i.state) for i in scan(root)]
    assert [s.location for s in summary] == [root.child(i.name).url for i in list_steps(root)]
    assert summary[4].problem is None and summary[2].problem is not None


def test_latest_skips_newer_damage_and_rollbacks_only(tmp_path: Path, staging: Path) -> None:
    volume = LocalVolume(tmp_path / "root")
    manager = CheckpointManager(volume, keep_last=None, write_pointer=False, staging=Staging(mode="sync"))
    assert latest(volume) is None and latest(volume, intact=False) is None
    manager.save(1, state(1))
    manager.save(2, state(2))
    found = latest(volume)
    assert found is not None and found.step == 2
    abandon(volume.child(checkpoint_name(2)))
    found = latest(volume)
    assert found is not None and found.step == 1
    broken = volume.child(checkpoint_name(1))
    broken.delete(data_files(broken)[0])
    assert latest(volume) is None
    found = latest(volume, intact=False)
    assert found is not None and found.step == 2


def test_a_broken_and_abandoned_checkpoint(tmp_path: Path, staging: Path) -> None:
    volume = LocalVolume(tmp_path / "root")
    CheckpointManager(volume, keep_last=None, staging=Staging(mode="sync")).save(7, state(7))
    location = volume.child(checkpoint_name(7))
    abandon(location)
    location.delete(data_files(location)[0])
    info = list_steps(volume)[0]
    # Listings show the damage and do not read the marker; latest() records the rollback.
    listed = inspect_step(volume, info)
    assert (listed.state, listed.abandoned) == ("broken", None)
    assert listed.problem is not None and "is missing" in listed.problem
    checked = inspect_step(volume, info, rollback_first=True)
    assert (checked.state, checked.abandoned) == ("abandoned", True)


def test_a_checkpoint_unpublished_after_the_listing(tmp_path: Path, staging: Path) -> None:
    volume = LocalVolume(tmp_path / "root")
    CheckpointManager(volume, keep_last=None, staging=Staging(mode="sync")).save(3, state(3))
    info = list_steps(volume)[0]
    volume.child(info.name).delete(METADATA_NAME)
    checked = inspect_step(volume, info)
    assert (checked.published, checked.state) == (False, "incomplete")
    assert checked.problem is not None and "no longer published" in checked.problem
    assert latest(volume, infos=[info]) is None


def test_each_store_call_goes_through_retry(root: Volume) -> None:
    calls: list[str] = []

    def retry(what, fn):
        calls.append(what)
        return fn()

    found = latest(root, retry=retry)
    assert found is not None and found.step == 1
    assert calls[0] == "list checkpoints"
    for name in ("step_00000004", "step_00000003", "step_00000002", "step_00000001"):
        assert f"read {name}/{METADATA_NAME}" in calls
    assert f"read step_00000002/{ABANDONED_NAME}" in calls
    assert "list step_00000004" not in calls  # an undecodable .metadata needs no listing


@pytest.mark.parametrize("what", ["read_bytes", "list_entries", "size"])
def test_store_errors_are_raised_never_a_state(root: Volume, monkeypatch, what: str) -> None:
    def fail(self, *args, **kwargs):
        raise TransferError(f"{what} failed: 503 SlowDown")

    monkeypatch.setattr(type(root), what, fail)
    if what == "size":
        # latest(), list_steps(), ls and gc never look up a .metadata's size (the GET or a listing
        # says it); what does look it up must raise too.
        assert [i.published for i in catalog.list_steps(root)] == [True, True, True, True, False]
        assert [i.step for i in scan(root)] == [1, 2, 3, 4, 5]
        with pytest.raises(TransferError, match="SlowDown"):
            catalog.latest(root, intact=False)
        return
    with pytest.raises(TransferError, match="SlowDown"):
        latest(root)
    for check in ("latest", "all") if what == "read_bytes" else catalog.CHECKS:
        with pytest.raises(TransferError, match="SlowDown"):
            scan(root, check=check)
        with pytest.raises(TransferError, match="SlowDown"):
            list_root(root, check=check)
    if what == "list_entries":
        with pytest.raises(TransferError, match="SlowDown"):
            catalog.list_steps(root)


def test_store_error_on_one_location_is_raised(root: Volume, monkeypatch) -> None:
    original = type(root).read_bytes

    def flaky(self, name):
        if self.url.rstrip("/").endswith(checkpoint_name(1)) and name == METADATA_NAME:
            raise TransferError("GET step_00000001/.metadata: connection reset")
        return original(self, name)

    monkeypatch.setattr(type(root), "read_bytes", flaky)
    # Steps 4, 3 and 2 are judged from evidence; step 1 cannot be judged: an error, not "no checkpoint".
    with pytest.raises(TransferError, match="connection reset"):
        latest(root)
    assert catalog.latest(root, intact=False) is not None


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_ls_counts_only_the_files_the_published_metadata_references(
    kind: str, tmp_path: Path, staging: Path, capsys
) -> None:
    """A save killed at a location that holds a published checkpoint (a re-save of the step after
    a restart) leaves its data files beside the published ones until gc: they are not part of the
    checkpoint, so ls neither counts them in its size nor in its files, and names them apart."""
    root = make_root(kind, tmp_path)
    CheckpointManager(root, keep_last=None, write_pointer=False, staging=Staging(mode="sync")).save(7, state(7))
    location = root.child(checkpoint_name(7))
    listing = location.list_files()
    own_data = sorted((manifest_of(read_metadata(location)) or {})["files"])
    assert own_data == data_files(location)
    own_bytes = listing[METADATA_NAME] + sum(listing[n] for n in own_data)
    # The killed save's file: another save's token, and bigger than the whole checkpoint.
    leftover = "__0_0badc0de_0.distcp"
    assert leftover not in own_data
    location.publish_bytes(leftover, b"x" * (2 * own_bytes), overwrite=True)

    (info,) = scan(root)
    assert info.state == "complete"
    assert (info.files, info.bytes) == (len(own_data), own_bytes), info
    assert (info.unreferenced_files, info.unreferenced_bytes) == (1, 2 * own_bytes), info
    (row,) = list_root(root)
    assert (row.files, row.bytes, row.unreferenced_files, row.unreferenced_bytes) == (
        len(own_data),
        own_bytes,
        1,
        2 * own_bytes,
    )

    from uc_checkpoint import cli

    assert cli.main(["ls", root.url]) == 0
    text = capsys.readouterr().out
    assert f"  {len(own_data):>5}  " in text.splitlines()[1], text  # the files column
    assert "also 1 unreferenced file, " in text and "uc-checkpoint gc" in text, text

    # Once gc has removed it, ls says nothing more of it.
    location.delete(leftover)
    (info,) = scan(root)
    assert (info.files, info.bytes, info.unreferenced_files) == (len(own_data), own_bytes, 0)


def test_checkpoint_names() -> None:
    assert checkpoint_name(42) == "step_00000042"
    assert checkpoint_name.__module__ == "uc_checkpoint.format.layout"  # one definition, beside the layout
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoint_name(-1)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_the_roots_one_listing_gives_each_locations_own(kind: str, tmp_path: Path) -> None:
    """``locations_below`` (one recursive listing of the root) gives every location's entries as
    its own listing (``checkpoint_entries``) does: spread prefixes opened, other sub-locations as
    one entry, files at the root and other names left out."""
    root = make_root(kind, tmp_path)
    for where, name in (
        ("step_00000001", METADATA_NAME),
        ("step_00000001", "__0_ab_0.distcp"),
        ("step_00000001/3a", "__5_ab_0.distcp"),
        ("step_00000001/3a/odd", "x"),
        ("step_00000001/notes", "y"),
        ("step_00000002/0", "__0_cd_0.distcp"),
        ("step_00000003", "__0_ef_0.distcp"),
        ("other", "z"),
        ("", "step_00000009"),  # a file, not a location
    ):
        location = root.child(where) if where else root
        location.prepare_for_write()
        location.publish_bytes(name, b"x" * len(name))
    root.child("step_00000004").prepare_for_write()  # an empty location (a save that just began)

    def own(entries) -> set:
        return {(e.name, e.size, e.mtime) for e in entries}

    found = locations_below(root, "step_")
    expected = {"step_00000001", "step_00000002", "step_00000003"}
    assert set(found) == expected | {"step_00000004"}, found  # both stores here have directories
    for name, entries in found.items():
        assert own(entries) == own(checkpoint_entries(root.child(name))), name
    assert {e.name for e in found["step_00000001"]} == {
        METADATA_NAME,
        "__0_ab_0.distcp",
        "3a/__5_ab_0.distcp",
        "3a/odd/",
        "notes/",
    }
    assert [(i.step, i.published) for i in list_steps(root)] == [(1, True), (2, False), (3, False), (4, False)]
