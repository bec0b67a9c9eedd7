"""The storage writers, readers and planners the benchmarks measure, by case name, for
:mod:`benchmarks.case` and :mod:`benchmarks.scale_case`:

* ``uc``: ``UCVolumeWriter`` / ``UCVolumeReader`` with ``UCSavePlanner``, the planner the README
  recommends beside them (``--dest`` a path, FUSE path or URL);
* ``uc-unsigned``: the same with SigV4's ``UNSIGNED-PAYLOAD`` on S3 (an option, not our default);
* ``fs``: DCP's stock ``FileSystemWriter`` / ``FileSystemReader`` on a path (local disk or a mount);
* ``floor``: :class:`CopyOnlyWriter` on a local path: DCP's floor for ``async_save``'s blocked time
  (``stage()`` is only the in-memory copy); its other figures are a local save's;
* ``fsspec``: DCP's ``FsspecWriter`` / ``FsspecReader`` (needs the ``s3fs`` Python package for s3://);
* ``s3tc``: s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader`` (needs that package).

Every case but ours runs with DCP's default planner.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch.distributed.checkpoint as dcp

from . import state

CASES = ("uc", "uc-unsigned", "fs", "floor", "fsspec", "s3tc")
#: The cases of our writer and reader.
OURS = ("uc", "uc-unsigned")


class CopyOnlyWriter(dcp.FileSystemWriter):
    """DCP's floor for the time ``dcp.async_save`` blocks training with synchronous staging: a
    ``FileSystemWriter`` (to local disk) whose ``stage()`` is exactly the in-memory copy the report
    compares with (:func:`benchmarks.state.cpu_copy`) and whose save thread hands the GIL back at its
    first call into the writer, as ours does. What it blocks beyond the copy is DCP's own: its work
    in ``async_save`` before and after ``stage()``, and starting the save's thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handed_over = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the snapshot is on CPU already
        return state.cpu_copy(state_dict)

    @property
    def checkpoint_id(self) -> Any:
        # DCP's first read on the save's thread (its logger): let the caller have the GIL, as
        # UCVolumeWriter does at the same point, so the floor is not this thread's Python work.
        if not self._handed_over and threading.current_thread() is not threading.main_thread():
            self._handed_over = True
            time.sleep(0.001)
        return super().checkpoint_id


def writer(case: str, dest: str, buffers: Any = None) -> Any:
    """The case's storage writer; ``buffers``: our writer's kept staging buffers (ours only)."""
    if case == "floor":
        return CopyOnlyWriter(dest)
    if case == "uc":
        from uc_checkpoint import UCVolumeWriter

        return UCVolumeWriter(dest, staging_buffers=buffers)
    if case == "uc-unsigned":
        from uc_checkpoint import UCVolumeWriter
        from uc_checkpoint.volumes import S3Volume

        # SigV4 with UNSIGNED-PAYLOAD, as s3torchconnector's CRT client signs every request
        # (aws-c-s3's default signing config): no SHA-256 over each body. An option, not our default.
        return UCVolumeWriter(S3Volume(dest, sign_payload=False), staging_buffers=buffers)
    if case == "fs":
        return dcp.FileSystemWriter(dest)
    if case == "fsspec":
        from torch.distributed.checkpoint import FsspecWriter

        return FsspecWriter(dest, sync_files=False)
    if case == "s3tc":
        from s3torchconnector.dcp import S3StorageWriter

        s3tc_writer = S3StorageWriter(region="us-east-1", path=dest)
        s3tc_writer.fs._client = _s3tc_client()
        return s3tc_writer
    raise ValueError(f"unknown case {case!r} (one of {', '.join(CASES)})")


def _s3tc_client() -> Any:
    # s3torchconnector's DCP classes take no endpoint; its S3Client does (the local server, path style).
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    return S3Client(
        region="us-east-1",
        endpoint=os.environ["AWS_ENDPOINT_URL"],
        s3client_config=S3ClientConfig(force_path_style=True),
    )


def reader(case: str, dest: str) -> Any:
    """The case's storage reader (the floor's checkpoints are stock ones on local disk)."""
    if case in OURS:  # a GET has no body to sign: the same reader
        from uc_checkpoint import UCVolumeReader

        return UCVolumeReader(dest)
    if case in ("fs", "floor"):
        return dcp.FileSystemReader(dest)
    if case == "fsspec":
        from torch.distributed.checkpoint import FsspecReader

        return FsspecReader(dest)
    if case == "s3tc":
        from s3torchconnector.dcp import S3StorageReader

        s3tc_reader = S3StorageReader(region="us-east-1", path=dest)
        s3tc_reader.fs._client = _s3tc_client()
        return s3tc_reader
    raise ValueError(f"unknown case {case!r} (one of {', '.join(CASES)})")


def staging_buffers(case: str) -> Any:
    """A :class:`~uc_checkpoint.StagingBuffers` for our cases, None for the others."""
    if case not in OURS:
        return None
    from uc_checkpoint import StagingBuffers

    return StagingBuffers()


def planner(case: str) -> Any:
    """Ours with the planner the README recommends beside it (small replicated items on one rank);
    DCP's default planner for every other case."""
    if case not in OURS:
        return None
    from uc_checkpoint import UCSavePlanner

    return UCSavePlanner()
