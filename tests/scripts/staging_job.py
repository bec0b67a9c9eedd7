"""One save or load through the real staging code path, as a separate process (a job, another user,
a save to be SIGKILLed mid-upload). Used by tests/integration/test_staging_reclaim.py.

Usage: staging_job.py save DEST MIB SEED   save a state of MIB MiB made from SEED to DEST
       staging_job.py load DEST MIB SEED   load DEST and check it is that state

Staging is the default (``$UC_CHECKPOINT_STAGING_DIR`` or the temp dir). The save writes one data
file (``file_size_bytes`` above the state's size), so a held upload (tests/scripts/upload_hold) has
the whole share staged. Logs at INFO on stderr (the reclaim's lines). Prints ``OK <op>`` on success;
on a failure prints ``FAILED <class>: <message>`` for each cause and exits 3.
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from uc_checkpoint import UCVolumeReader, UCVolumeWriter
from uc_checkpoint.dcp.options import WriterOptions

warnings.filterwarnings("ignore")


def state(mib: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * (1 << 18), generator=g), "meta": {"seed": seed}}


def causes(exc: BaseException) -> list[BaseException]:
    """``exc``'s chain, and for DCP's CheckpointException every rank's exception and its chain."""
    found: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e in found:
            continue
        found.append(e)
        if isinstance(e, CheckpointException):
            for failure in e.failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)
    return found


def main() -> int:
    op, dest, mib, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    want = state(mib, seed)
    try:
        if op == "save":
            writer = UCVolumeWriter(
                dest, sync_files=False, options=WriterOptions(file_size_bytes=(mib + 1) << 20, upload_workers=1)
            )
            dcp.save(want, storage_writer=writer, no_dist=True)
        else:
            got = {"w": torch.zeros_like(want["w"]), "meta": {"seed": -1}}
            dcp.load(got, storage_reader=UCVolumeReader(dest), no_dist=True)
            if not torch.equal(got["w"], want["w"]) or got["meta"] != want["meta"]:
                print(f"FAILED MismatchError: {dest} does not hold the state of seed {seed}", flush=True)
                return 3
    except BaseException as exc:  # noqa: BLE001  (CheckpointException is a BaseException)
        for e in causes(exc):
            print(f"FAILED {type(e).__name__}: {e}", flush=True)
        return 3
    print(f"OK {op}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
