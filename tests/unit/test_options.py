"""Typed writer/reader settings (uc_checkpoint.ops.options): checked once, when the manager is
built, and the same defaults as the writer's and reader's constructors."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from uc_checkpoint.dcp.reader import UCVolumeReader
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.ops.manager import CheckpointManager
from uc_checkpoint.ops.options import ReaderOptions, WriterOptions

# staging_buffers: an object kept across saves (CheckpointManager(reuse_staging_buffers=True) owns one);
# mlflow_run_id: the run the manager logs to, recorded per save
MANAGER_OWNED = {"self", "path", "staging_dir", "volume_options", "staging_buffers", "mlflow_run_id"}
# Taken for drop-in use in place of DCP's FileSystemWriter/Reader; the options carry ours.
DCP_SPELLINGS = {
    "single_file_per_rank",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "serialization_format",
    "_extensions",
    "_extension_registry",
}


@pytest.mark.parametrize(("options", "component"), [(WriterOptions, UCVolumeWriter), (ReaderOptions, UCVolumeReader)])
def test_fields_and_defaults_are_the_constructors(options, component) -> None:
    params = {
        name: p.default
        for name, p in inspect.signature(component.__init__).parameters.items()
        if name not in MANAGER_OWNED | DCP_SPELLINGS
    }
    fields = {f.name: f.default for f in dataclasses.fields(options)}
    assert fields == params
    assert list(options()) == list(params)  # reads as a mapping of its fields, in order
    assert options._RULES.keys() == fields.keys()  # every field is checked


@pytest.mark.parametrize(
    ("options", "given", "error", "match"),
    [
        (WriterOptions, {"upload_workers": 0}, ValueError, "upload_workers must be >= 1, got 0"),
        (WriterOptions, {"thread_count": -1}, ValueError, "thread_count must be >= 1"),
        (WriterOptions, {"file_size_bytes": 0}, ValueError, "file_size_bytes must be >= 1"),
        (WriterOptions, {"upload_workers": True}, TypeError, "upload_workers must be int, got bool"),
        (WriterOptions, {"upload_workers": 2.0}, TypeError, "upload_workers must be int, got float"),
        (WriterOptions, {"file_size_bytes": "64MiB"}, TypeError, "file_size_bytes must be int or None, got str"),
        (WriterOptions, {"sync_files": 1}, TypeError, "sync_files must be bool, got int"),
        (
            WriterOptions,
            {"sync_file": False},
            TypeError,
            "unknown writer option 'sync_file'; the options are .*sync_files",
        ),
        (
            WriterOptions,
            {"staging_dir": "/tmp"},
            TypeError,
            r"'staging_dir' .* CheckpointManager\(staging_dir=\.\.\.\)",
        ),
        (ReaderOptions, {"download_workers": 0}, ValueError, "download_workers must be >= 1"),
        (ReaderOptions, {"range_gap_bytes": -1}, ValueError, "range_gap_bytes must be >= 0"),
        (ReaderOptions, {"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes must be >= 1"),
        (ReaderOptions, {"range_chunk_bytes": 4095}, ValueError, "range_chunk_bytes must be >= 65536"),
        (ReaderOptions, {"prefetch_files": "yes"}, TypeError, "prefetch_files must be bool or None, got str"),
        (ReaderOptions, {"verify_checksum": False}, TypeError, "unknown reader option 'verify_checksum'"),
        (ReaderOptions, {"upload_workers": 2}, TypeError, "unknown reader option 'upload_workers'"),
    ],
)
def test_bad_options_are_named(options, given, error, match) -> None:
    with pytest.raises(error, match=match):
        options.coerce(given)
    if "unknown" not in match and "CheckpointManager" not in match:
        with pytest.raises(error, match=match):
            options(**given)  # the dataclass itself checks, not only from_dict


def test_good_options() -> None:
    assert WriterOptions.coerce(None) == WriterOptions()
    assert ReaderOptions.coerce({"range_gap_bytes": 0, "prefetch_files": False}) == ReaderOptions(
        range_gap_bytes=0, prefetch_files=False
    )
    opts = WriterOptions(file_size_bytes=1 << 20)
    assert WriterOptions.coerce(opts) is opts
    assert opts["file_size_bytes"] == 1 << 20 and dict(opts)["upload_workers"] == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.upload_workers = 8  # type: ignore[misc]
    with pytest.raises(TypeError, match="writer options must be a WriterOptions or a dict, got ReaderOptions"):
        WriterOptions.coerce(ReaderOptions())  # type: ignore[arg-type]


def test_the_manager_checks_options_when_built(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown writer option 'file_size'"):
        CheckpointManager(str(tmp_path / "run"), writer_options={"file_size": 1})
    with pytest.raises(ValueError, match="download_workers must be >= 1"):
        CheckpointManager(str(tmp_path / "run"), reader_options={"download_workers": 0})
    with pytest.raises(TypeError, match="reader options must be a ReaderOptions or a dict, got list"):
        CheckpointManager(str(tmp_path / "run"), reader_options=[("download_workers", 2)])  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("typed", [False, True])
def test_the_manager_passes_options_on(
    tmp_path: Path, staging: Path, monkeypatch: pytest.MonkeyPatch, typed: bool
) -> None:
    writer = {"file_size_bytes": 4096, "sync_files": False}
    reader = {"prefetch_files": False, "download_workers": 2}
    manager = CheckpointManager(
        str(tmp_path / "run"),
        async_save=False,
        writer_options=WriterOptions(**writer) if typed else writer,
        reader_options=ReaderOptions(**reader) if typed else reader,
    )
    seen: dict[str, dict] = {}
    for cls, key in ((UCVolumeWriter, "writer"), (UCVolumeReader, "reader")):
        init = cls.__init__

        def spy(self, path, *, _init=init, _key=key, **kwargs):
            seen[_key] = kwargs
            _init(self, path, **kwargs)

        monkeypatch.setattr(cls, "__init__", spy)
    sd = {f"t{i}": torch.full((512,), float(i)) for i in range(8)}  # 16 KiB: several 4 KiB files
    manager.save(1, sd)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    assert manager.load(target, step=1) == 1
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    assert seen["writer"]["file_size_bytes"] == 4096 and seen["writer"]["sync_files"] is False
    assert seen["reader"]["prefetch_files"] is False and seen["reader"]["download_workers"] == 2
    data_files = [p for p in (tmp_path / "run" / "step_00000001").iterdir() if p.name.endswith(".distcp")]
    assert len(data_files) > 1  # file_size_bytes reached the writer


def test_volume_options_in_writer_or_reader_options_name_the_managers_argument() -> None:
    for options in (WriterOptions, ReaderOptions):
        with pytest.raises(
            TypeError,
            match=r"'volume_options' is not a .* option here: pass CheckpointManager\(volume_options=\.\.\.\)",
        ):
            options.coerce({"volume_options": {"max_attempts": 3}})


def test_the_managers_options_stay_adjustable(tmp_path) -> None:
    from uc_checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "root", writer_options=WriterOptions(upload_workers=2), async_save=False)
    assert manager.writer_options.upload_workers == 2
    # Typed, and replaced whole (checked again): the next save takes it.
    manager.writer_options = dataclasses.replace(manager.writer_options, upload_workers=3)
    assert manager.writer_options.upload_workers == 3
    with pytest.raises(ValueError, match="upload_workers must be >= 1"):
        dataclasses.replace(manager.writer_options, upload_workers=0)
    # A dict given to the manager is held as the options it stands for.
    given = CheckpointManager(tmp_path / "root", reader_options={"download_workers": 2}, async_save=False)
    assert given.reader_options == ReaderOptions(download_workers=2)


@pytest.mark.parametrize("chunk", [1, 4095, (64 << 10) - 1])
def test_the_reader_refuses_ranged_gets_of_a_few_bytes(chunk: int, tmp_path: Path) -> None:
    # A range widened to a 4 MiB checksum block, in pieces of a few bytes, is millions of requests.
    with pytest.raises(ValueError, match=rf"range_chunk_bytes must be >= 65536 \(64 KiB.*got {chunk}"):
        UCVolumeReader(str(tmp_path), range_chunk_bytes=chunk)
    assert UCVolumeReader(str(tmp_path), range_chunk_bytes=64 << 10).range_chunk_bytes == 64 << 10
