"""Full verification of one checkpoint (``uc-checkpoint verify``): its ``.metadata`` decodes (with the
restricted unpickler), every data file it references exists with the recorded size, and every byte
of every file matches the manifest's CRC-32 (whole file and per block). Files are streamed in ranges,
never staged on disk, a few at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from uc_checkpoint.dcp.metadata_io import manifest_of, read_metadata, referenced_files
from uc_checkpoint.engine.listing import checkpoint_files
from uc_checkpoint.errors import CorruptCheckpointError
from uc_checkpoint.format.integrity import Digest, FileRecord
from uc_checkpoint.format.layout import manifest_records
from uc_checkpoint.ops.catalog import file_problems
from uc_checkpoint.volumes import Volume, open_volume
from uc_checkpoint.volumes.workers import Workers

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_checkpoint`.

    Attributes:
        location: the checkpoint's path or URL.
        files_checked: data files the metadata references that were checked (presence and size).
        files_checksummed: of those, files read in full and compared with the manifest's CRC-32s.
        bytes_checked: bytes read.
        checksums: whether the checkpoint has a manifest (stock ``FileSystemWriter`` checkpoints do
            not: only their presence and sizes can be checked).
        problems: one line per problem found, each naming the file; empty when the checkpoint is good.
    """

    location: str
    files_checked: int = 0
    files_checksummed: int = 0
    bytes_checked: int = 0
    checksums: bool = True
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_file(volume: Volume, record: FileRecord, progress: Callable[[int], None] | None) -> str | None:
    digest = Digest(block_size=record.block_size) if record.block_size else Digest()
    pos = 0
    while pos < record.size:
        end = min(record.size, pos + CHUNK_BYTES)
        data = volume.read_range(record.name, pos, end)
        digest.update(data)
        pos = end
        if progress is not None:
            progress(len(data))
    got = digest.record(record.name)
    where = volume.url_of(record.name)
    if got.crc32 != record.crc32:
        return f"{where} fails its checksum: crc32 {got.crc32}, recorded {record.crc32}"
    if record.block_crc32 and got.block_crc32 != record.block_crc32:
        return f"{where} fails a block checksum"
    return None


def verify_checkpoint(
    location: str | Volume, *, workers: int = 4, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Check every file of the checkpoint at ``location`` (see the module docstring).

    ``progress`` is called with the number of bytes read after every range (for a progress bar).
    Problems with the checkpoint (a damaged ``.metadata``, missing, short or corrupt data files) are
    collected in the report, not raised. A location with no checkpoint at all raises, and so does a
    store that fails to answer: that says nothing about the checkpoint, so it is never reported as a
    problem with it.

    Raises:
        VolumeError: ``location`` is not a usable path or URL, or the store is unusable.
        TransferError: the store failed to list the location or to return a file's bytes (after the
            store client's retries); the message names the file.
        CheckpointNotFoundError: no ``.metadata`` is published at ``location``.
    """
    volume = location if isinstance(location, Volume) else open_volume(location)
    report = VerifyReport(location=volume.url)
    try:
        try:
            metadata = read_metadata(volume)
        except CorruptCheckpointError as exc:
            report.problems.append(str(exc))
            return report
        records = manifest_records(manifest_of(metadata))
        report.checksums = bool(records)
        referenced = referenced_files(metadata)
        report.files_checked = len(referenced)
        bad = file_problems(volume, metadata, checkpoint_files(volume))
        report.problems.extend(bad.values())
        to_read = [records[name] for name in sorted(referenced) if name not in bad and name in records]
        with Workers(max(1, workers), thread_name_prefix="uc-verify") as pool:
            futures = {pool.submit(_check_file, volume, r, progress): r for r in to_read}
            try:
                for fut, record in futures.items():
                    try:
                        problem = fut.result()
                    except CorruptCheckpointError as exc:
                        problem = str(exc)
                    report.files_checksummed += 1
                    report.bytes_checked += record.size
                    if problem:
                        report.problems.append(problem)
            except BaseException:
                for other in futures:  # the verdict is lost: read no more
                    other.cancel()
                raise
    finally:
        volume.close()
    logger.info(
        "verify %s: %d files, %d bytes, %d problems",
        volume.url,
        report.files_checked,
        report.bytes_checked,
        len(report.problems),
    )
    return report


__all__ = ["VerifyReport", "verify_checkpoint"]
