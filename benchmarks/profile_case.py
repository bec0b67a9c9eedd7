"""The process :mod:`benchmarks.profile` samples: saves and loads a GPT-like state to S3 (the ``flat``
kind of :mod:`benchmarks.state`: float32 tensors of 16, 4 and 1 MiB in turn), each phase gated by
files so the profiler attaches to exactly that phase.

    python -m benchmarks.profile_case s3://bucket/prefix SIZE_MB REPEATS WORKDIR
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import torch.distributed.checkpoint as dcp

from . import state
from .usage import cpu_s


def _gate(work: Path, phase: str) -> None:
    (work / f"{phase}.ready").touch()
    while not (work / f"{phase}.go").exists():
        time.sleep(0.02)


def main() -> None:
    from uc_checkpoint import UCVolumeReader, UCVolumeWriter
    from uc_checkpoint.volumes import S3Volume

    url, size_mb, repeats, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    sd = state.build("flat", size_mb << 20)
    S3Volume(url).client  # noqa: B018 - botocore reads its models once per process, before sampling
    paths = [f"{url}/{uuid.uuid4().hex[:8]}" for _ in range(repeats)]
    _gate(work, "save")
    c0 = cpu_s()
    for path in paths:
        dcp.save(sd, storage_writer=UCVolumeWriter(path))
    (work / "save.cpu").write_text(str(cpu_s() - c0))
    (work / "save.done").touch()
    targets = [state.build("flat", size_mb << 20, zeros=True) for _ in paths]  # before sampling
    _gate(work, "load")
    c0 = cpu_s()
    for path, target in zip(paths, targets):
        dcp.load(target, storage_reader=UCVolumeReader(path))
    (work / "load.cpu").write_text(str(cpu_s() - c0))
    (work / "load.done").touch()
    state.assert_equal(sd, targets[-1])


if __name__ == "__main__":
    main()
