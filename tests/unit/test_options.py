"""The writer's, reader's and saves' settings (uc_checkpoint.dcp.options): each declared, defaulted
and checked once, in a frozen dataclass, and taken as they are by the writer, the reader and the
manager."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

from uc_checkpoint.dcp import options as options_module
from uc_checkpoint.dcp.options import ReaderOptions, Staging, WriterOptions
from uc_checkpoint.dcp.reader import UCVolumeReader
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.ops.manager import CheckpointManager

PACKAGE = Path(__file__).resolve().parents[2] / "uc_checkpoint"


@pytest.mark.parametrize(
    ("options", "given", "error", "match"),
    [
        (WriterOptions, {"upload_workers": 0}, ValueError, r"WriterOptions\.upload_workers must be >= 1, got 0"),
        (WriterOptions, {"thread_count": -1}, ValueError, "thread_count must be >= 1"),
        (WriterOptions, {"file_size_bytes": 0}, ValueError, "file_size_bytes must be >= 1"),
        (WriterOptions, {"per_thread_copy_ahead": -1}, ValueError, "per_thread_copy_ahead must be >= 0"),
        (WriterOptions, {"upload_workers": True}, TypeError, "upload_workers must be an int, got bool"),
        (WriterOptions, {"upload_workers": 2.0}, TypeError, "upload_workers must be an int, got float"),
        (WriterOptions, {"file_size_bytes": "64MiB"}, TypeError, "file_size_bytes must be an int or None, got str"),
        (WriterOptions, {"sync_files": 1}, TypeError, "sync_files must be a bool, got int"),
        (WriterOptions, {"single_file_per_rank": 1}, TypeError, "single_file_per_rank must be a bool or None, got int"),
        (WriterOptions, {"spread_prefixes": 257}, ValueError, "spread_prefixes must be <= 256, got 257"),
        (
            WriterOptions,
            {"single_file_per_rank": True, "file_size_bytes": 1 << 20},
            ValueError,
            "single_file_per_rank or file_size_bytes, not both",
        ),
        (WriterOptions, {"sync_file": False}, TypeError, "unexpected keyword argument 'sync_file'"),
        (ReaderOptions, {"download_workers": 0}, ValueError, "download_workers must be >= 1"),
        (ReaderOptions, {"range_gap_bytes": -1}, ValueError, "range_gap_bytes must be >= 0"),
        (ReaderOptions, {"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes must be >= 1"),
        (ReaderOptions, {"range_chunk_bytes": 4095}, ValueError, "range_chunk_bytes must be >= 65536"),
        (ReaderOptions, {"prefetch_files": "yes"}, TypeError, "prefetch_files must be a bool or None, got str"),
        (ReaderOptions, {"verify_checksum": False}, TypeError, "unexpected keyword argument 'verify_checksum'"),
        (ReaderOptions, {"upload_workers": 2}, TypeError, "unexpected keyword argument 'upload_workers'"),
        (
            Staging,
            {"mode": "fork"},
            ValueError,
            r"Staging\.mode must be one of 'thread', 'process', 'sync', got 'fork'",
        ),
        (Staging, {"mode": 1}, TypeError, r"Staging\.mode must be a str, got int"),
        (Staging, {"background_copy": "yes"}, TypeError, "background_copy must be a bool, got str"),
        (Staging, {"mode": "sync", "background_copy": True}, ValueError, "background_copy=True needs mode 'thread' or"),
        (Staging, {"mode": "process", "reuse_buffers": True}, ValueError, "reuse_buffers=True needs mode='thread'"),
        (
            Staging,
            {"background_copy": True, "reuse_buffers": True},
            ValueError,
            "reuse_buffers=True needs mode='thread' and background_copy=False",
        ),
    ],
)
def test_bad_settings_are_named_where_they_are_declared(options, given, error, match) -> None:
    with pytest.raises(error, match=match):
        options(**given)
    if error is ValueError and options is not Staging and len(given) == 1:
        # Checked again when one field is replaced (the dataclass checks, nothing else does).
        with pytest.raises(error, match=match):
            dataclasses.replace(options(), **given)


def test_good_settings_are_frozen_values() -> None:
    opts = WriterOptions(file_size_bytes=1 << 20)
    assert opts.file_size_bytes == 1 << 20 and opts.upload_workers == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.upload_workers = 8  # type: ignore[misc]
    assert ReaderOptions(range_gap_bytes=0, prefetch_files=False) == ReaderOptions(
        prefetch_files=False, range_gap_bytes=0
    )
    assert Staging().mode == "thread" and Staging().asynchronous and not Staging(mode="sync").asynchronous
    assert Staging(reuse_buffers=True).reuse_buffers and Staging(mode="process", background_copy=True).background_copy


def test_each_setting_is_defaulted_in_one_place() -> None:
    """No second copy of a default: each field's default is written once in the DCP layer and the
    manager, in its dataclass, and the writer's and reader's constructors take every one of them through
    ``options`` (FileSystemWriter's keyword arguments default to None: "as the options say")."""
    for cls, component in ((WriterOptions, UCVolumeWriter), (ReaderOptions, UCVolumeReader)):
        params = inspect.signature(component.__init__).parameters
        for field in dataclasses.fields(cls):
            if field.name in params:  # a FileSystemWriter keyword argument, taken for drop-in use
                assert params[field.name].default is None, field.name
            if field.default is None:
                continue  # None is "not set" anywhere: nothing to keep equal
            # ``name: <type> = <value>``: a dataclass field or an annotated parameter with a default.
            spelled = re.compile(rf"\b{field.name}\s*:\s*[\w\[\]|. ]+=\s*(?!None\b)\S")
            defined = [
                str(path.relative_to(PACKAGE))
                for path in [
                    *(PACKAGE / "dcp").glob("*.py"),
                    *(PACKAGE / "ops").glob("*options.py"),
                    *(PACKAGE / "ops").glob("manager.py"),
                ]
                for line in path.read_text().splitlines()
                if spelled.search(line)
            ]
            assert defined == ["dcp/options.py"], (field.name, defined)
    assert options_module.__file__.endswith("dcp/options.py")


def test_the_writer_and_reader_take_their_options_and_dcps_arguments(tmp_path: Path) -> None:
    writer = UCVolumeWriter(tmp_path, options=WriterOptions(upload_workers=2, thread_count=2), sync_files=False)
    assert writer.options == WriterOptions(upload_workers=2, thread_count=2, sync_files=False)
    assert writer.thread_count == 2  # where DCP's FileSystemWriter keeps it, too
    with pytest.raises(ValueError, match=r"WriterOptions\.thread_count must be >= 1, got 0"):
        UCVolumeWriter(tmp_path, thread_count=0)  # checked by the options, as given
    with pytest.raises(TypeError, match="options must be a WriterOptions, got dict"):
        UCVolumeWriter(tmp_path, options={"upload_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options must be a ReaderOptions, got WriterOptions"):
        UCVolumeReader(tmp_path, options=WriterOptions())  # type: ignore[arg-type]
    assert UCVolumeReader(tmp_path).options == ReaderOptions()


def test_the_manager_checks_its_settings_when_built(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"writer must be a uc_checkpoint\.WriterOptions or None, got dict"):
        CheckpointManager(str(tmp_path / "run"), writer={"file_size_bytes": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reader must be a uc_checkpoint\.ReaderOptions or None, got list"):
        CheckpointManager(str(tmp_path / "run"), reader=[("download_workers", 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"staging must be a uc_checkpoint\.Staging or None, got str"):
        CheckpointManager(str(tmp_path / "run"), staging="sync")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="writer must be .* got ReaderOptions"):
        CheckpointManager(str(tmp_path / "run"), writer=ReaderOptions())  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_the_manager_passes_options_on(tmp_path: Path, staging: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = WriterOptions(file_size_bytes=4096, sync_files=False)
    reader = ReaderOptions(prefetch_files=False, download_workers=2)
    manager = CheckpointManager(str(tmp_path / "run"), staging=Staging(mode="sync"), writer=writer, reader=reader)
    seen: dict[str, object] = {}
    for cls, key in ((UCVolumeWriter, "writer"), (UCVolumeReader, "reader")):
        init = cls.__init__

        def spy(self, path, *, _init=init, _key=key, **kwargs):
            _init(self, path, **kwargs)
            seen[_key] = self.options

        monkeypatch.setattr(cls, "__init__", spy)
    sd = {f"t{i}": torch.full((512,), float(i)) for i in range(8)}  # 16 KiB: several 4 KiB files
    manager.save(1, sd)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert manager.load(target, step=1) == 1
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    assert seen == {"writer": writer, "reader": reader}
    data_files = [p for p in (tmp_path / "run" / "step_00000001").iterdir() if p.name.endswith(".distcp")]
    assert len(data_files) > 1  # file_size_bytes reached the writer


def test_the_managers_options_stay_adjustable(tmp_path) -> None:
    manager = CheckpointManager(tmp_path / "root", writer=WriterOptions(upload_workers=2), staging=Staging(mode="sync"))
    assert manager.writer_options.upload_workers == 2
    # Typed, and replaced whole (checked again): the next save takes it.
    manager.writer_options = dataclasses.replace(manager.writer_options, upload_workers=3)
    assert manager.writer_options.upload_workers == 3
    with pytest.raises(ValueError, match="upload_workers must be >= 1"):
        dataclasses.replace(manager.writer_options, upload_workers=0)
    assert CheckpointManager(tmp_path / "root").reader_options == ReaderOptions()
    assert CheckpointManager(tmp_path / "root").staging == Staging()


@pytest.mark.parametrize("chunk", [1, 4095, (64 << 10) - 1])
def test_the_reader_refuses_ranged_gets_of_a_few_bytes(chunk: int, tmp_path: Path) -> None:
    # A range widened to a 4 MiB checksum block, in pieces of a few bytes, is millions of requests.
    with pytest.raises(ValueError, match=rf"range_chunk_bytes must be >= 65536 \(64 KiB.*got {chunk}"):
        ReaderOptions(range_chunk_bytes=chunk)
    reader = UCVolumeReader(str(tmp_path), options=ReaderOptions(range_chunk_bytes=64 << 10))
    assert reader.options.range_chunk_bytes == 64 << 10
