"""Mounts that refuse to overwrite files, and housekeeping whose steps fail one at a time.

Mountpoint for S3 without ``--allow-overwrite`` refuses to open an existing file for writing (EPERM)
and does not implement rename; deletes are allowed. No such FUSE mount can be made here, so the
volume directory is made to behave like one: ``os.replace``/``os.link`` into it fail with
ENOTSUP/EPERM, and opening an existing file there for writing fails with EPERM (through the ``open``
LocalVolume calls). Everything else (the files, the deletes, DCP, the manager) is real.

Required: the ``latest`` pointer is replaced by delete-then-create, retention keeps exactly
``keep_last`` checkpoints, and every post-publish step runs whatever happened to the other (a pointer
that cannot be written must not stop retention, nor the reverse).
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.errors import CheckpointExistsError, TransferError
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.volumes import LocalVolume
from uc_checkpoint.volumes import local as local_module


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "meta": {"step": step}}


def blank() -> dict:
    return {"w": torch.zeros(64, 32), "meta": {"step": -1}}


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def _inside(path: object, root: Path) -> bool:
    return Path(os.fspath(path)).resolve().is_relative_to(root.resolve())  # type: ignore[arg-type]


class RefusingMount:
    """Makes the directory ``root`` refuse what Mountpoint without ``--allow-overwrite`` refuses;
    ``refused`` counts each refusal by operation, so a test can check the refusals were reached."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, refuse_deleting: str | None = None) -> None:
        self.root = root
        self.refused: Counter[str] = Counter()
        real_replace, real_link, real_unlink = os.replace, os.link, Path.unlink

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if _inside(dst, root):
                self.refused["rename"] += 1
                raise OSError(errno.ENOTSUP, "Operation not supported", os.fspath(dst))
            return real_replace(src, dst, *args, **kwargs)

        def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if _inside(dst, root):
                self.refused["link"] += 1
                raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(dst))
            return real_link(src, dst, *args, **kwargs)

        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if (
                isinstance(file, (str, os.PathLike))
                and any(c in mode for c in "wa+")
                and _inside(file, root)
                and os.path.exists(file)
            ):
                self.refused["overwrite"] += 1
                raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(file))
            return builtins.open(file, mode, *args, **kwargs)

        def unlink(path: Path, missing_ok: bool = False) -> None:
            if refuse_deleting is not None and path.name == refuse_deleting and _inside(path, root):
                self.refused["delete"] += 1
                raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
            real_unlink(path, missing_ok=missing_ok)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "link", link)
        # LocalVolume opens files by the name ``open``; a module global shadows the builtin there only.
        monkeypatch.setattr(local_module, "open", open_, raising=False)
        monkeypatch.setattr(Path, "unlink", unlink)


def test_four_saves_keep_two_and_the_pointer_follows(tmp_path: Path, staging: Path, monkeypatch, caplog) -> None:
    root = tmp_path / "mnt" / "run"
    mount = RefusingMount(tmp_path / "mnt", monkeypatch)
    manager = CheckpointManager(str(root), keep_last=2)  # async saves: housekeeping runs in the callback
    with caplog.at_level(logging.INFO, logger="uc_checkpoint"):
        for step in range(1, 5):
            manager.save(step, state(step))
        manager.wait()
    assert mount.refused["rename"] >= 4 and mount.refused["overwrite"] >= 3, mount.refused  # steps 2-4's pointer
    assert steps_on_disk(root) == [3, 4]
    assert json.loads((root / "latest").read_text())["step"] == 4
    assert "refuses to overwrite existing files" in caplog.text
    assert "failed" not in caplog.text, caplog.text
    assert not [p.name for p in root.iterdir() if p.name.endswith(".tmp")]
    assert manager.latest() == 4
    target = blank()
    assert manager.load(target) == 4 and torch.equal(target["w"], state(4)["w"])


def test_saving_a_step_again_replaces_its_metadata(tmp_path: Path, staging: Path, monkeypatch) -> None:
    # A resumed job saves a step it saved before: the location's .metadata must be replaced on a mount
    # that cannot overwrite it, and the old checkpoint's data files go once the new one is published.
    root = tmp_path / "mnt" / "run"
    mount = RefusingMount(tmp_path / "mnt", monkeypatch)
    manager = CheckpointManager(str(root), keep_last=None, staging=Staging(mode="sync"))
    manager.save(5, state(5))
    old_files = {p.name for p in (root / "step_00000005").glob("*.distcp")}
    overwrites = mount.refused["overwrite"]
    manager.save(5, state(50))
    assert mount.refused["overwrite"] > overwrites
    new_files = {p.name for p in (root / "step_00000005").glob("*.distcp")}
    assert new_files and not new_files & old_files
    target = blank()
    assert manager.load(target) == 5 and torch.equal(target["w"], state(50)["w"]) and target["meta"] == {"step": 50}


def test_publish_bytes_on_a_refusing_mount(tmp_path: Path, monkeypatch, caplog) -> None:
    mount = RefusingMount(tmp_path, monkeypatch)
    volume = LocalVolume(tmp_path / "loc")
    volume.prepare_for_write()
    volume.publish_bytes("f", b"one", overwrite=False)  # a new file: written in place
    with pytest.raises(CheckpointExistsError, match="loc/f already exists"):
        volume.publish_bytes("f", b"two", overwrite=False)
    assert (tmp_path / "loc" / "f").read_bytes() == b"one"
    with caplog.at_level(logging.INFO, logger="uc_checkpoint.volumes.local"):
        volume.publish_bytes("f", b"three", overwrite=True)
    assert (tmp_path / "loc" / "f").read_bytes() == b"three" and mount.refused["overwrite"] == 1
    assert "refuses to overwrite existing files" in caplog.text
    assert sorted(p.name for p in (tmp_path / "loc").iterdir()) == ["f"]  # no temp file left


def test_a_mount_that_refuses_overwrite_and_delete_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    # Mountpoint with neither --allow-overwrite nor --allow-delete: the pointer cannot be replaced
    # at all; the error says so and the old content stays.
    mount = RefusingMount(tmp_path, monkeypatch, refuse_deleting="latest")
    volume = LocalVolume(tmp_path)
    volume.publish_bytes("latest", b"old", overwrite=True)
    with pytest.raises(TransferError, match=r"latest failed: the mount refuses to overwrite it .* and to delete it"):
        volume.publish_bytes("latest", b"new", overwrite=True)
    assert (tmp_path / "latest").read_bytes() == b"old" and mount.refused["delete"] == 1


def test_retention_failing_does_not_stop_the_pointer(tmp_path: Path, staging: Path, monkeypatch, caplog) -> None:
    # Deleting checkpoint files is refused (say, an object lock on the bucket behind the mount):
    # retention fails at every save from step 3 on, the pointer is still written each time.
    root = tmp_path / "mnt" / "run"
    mount = RefusingMount(tmp_path / "mnt", monkeypatch, refuse_deleting=".metadata")
    manager = CheckpointManager(str(root), keep_last=2, staging=Staging(mode="sync"))
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.ops.manager"):
        for step in range(1, 5):
            manager.save(step, state(step))
    assert mount.refused["delete"] >= 2
    assert (
        "after publishing step 4 under" in caplog.text and "retention (deleting old checkpoints) failed" in caplog.text
    )
    assert str(root) in caplog.text and "step_00000001" in caplog.text  # where: the location it could not delete
    assert json.loads((root / "latest").read_text())["step"] == 4
    assert steps_on_disk(root) == [1, 2, 3, 4] and manager.latest() == 4


def test_pointer_failing_does_not_stop_retention(tmp_path: Path, staging: Path, caplog) -> None:
    # A real fault, no patching: something made the pointer's name a directory, so it cannot be
    # replaced. Retention must still keep exactly keep_last checkpoints.
    root = tmp_path / "run"
    (root / "latest").mkdir(parents=True)
    manager = CheckpointManager(str(root), keep_last=2)
    with caplog.at_level(logging.WARNING, logger="uc_checkpoint.ops.manager"):
        for step in range(1, 5):
            manager.save(step, state(step))
        manager.wait()
    assert "after publishing step 4 under" in caplog.text and "writing the latest pointer failed" in caplog.text
    assert "latest" in caplog.text and str(root) in caplog.text
    assert steps_on_disk(root) == [3, 4]
    assert manager.latest() == 4
    target = blank()
    assert manager.load(target) == 4 and target["meta"] == {"step": 4}
