"""A script that starts an async save and ends at once, as users write them.

Usage: exit_with_save_in_flight.py KIND MODE LOCATION [PG_FILE]
    KIND: ``writer`` (``dcp.async_save`` with ``UCVolumeWriter``), ``stager`` (the same with DCP's
    ``DefaultStager`` staging asynchronously), ``manager`` (``CheckpointManager.save``, step 5,
    under LOCATION as root) or ``late`` (a synchronous ``dcp.save`` that a non-daemon thread starts
    once the interpreter's exit has begun: after ``concurrent.futures`` refused new work).
    MODE: ``thread`` or ``process`` (DCP's async_checkpointer_type; process needs PG_FILE for a
    1-rank gloo group).
The state holds ``w`` = 7s and ``big`` = arange(3e6) (12 MB, so the save is still running at exit).
Prints ``SCRIPT END`` and returns without waiting.
"""

from __future__ import annotations

import concurrent.futures.thread
import sys
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from uc_checkpoint import UCVolumeWriter
from uc_checkpoint.dcp.options import Staging, WriterOptions
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")


def main() -> None:
    kind, mode, location = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "process":
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[4]}", rank=0, world_size=1)
    state = {"w": torch.full((1000,), 7.0), "big": torch.arange(3_000_000, dtype=torch.float32)}
    if kind in ("writer", "stager"):
        kind_of = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
        # "stager": DCP's own stager copies in a thread of its own, so none of the writer's hooks
        # has run when the script ends.
        stager = DefaultStager(StagingOptions(False, False, True, False)) if kind == "stager" else None
        dcp.async_save(
            state,
            storage_writer=UCVolumeWriter(location, options=WriterOptions(file_size_bytes=2 << 20)),
            async_checkpointer_type=kind_of,
            async_stager=stager,
        )
    elif kind == "late":

        def late() -> None:
            # Wait for the exit to start: concurrent.futures' exit callback has set its flag.
            while not concurrent.futures.thread._shutdown:  # type: ignore[attr-defined]
                threading.Event().wait(0.01)
            dcp.save(
                state,
                storage_writer=UCVolumeWriter(location, options=WriterOptions(file_size_bytes=2 << 20)),
                no_dist=True,
            )
            print("LATE SAVE DONE", flush=True)

        threading.Thread(target=late, daemon=False).start()
    else:
        manager = CheckpointManager(location, staging=Staging(mode=mode), writer=WriterOptions(file_size_bytes=2 << 20))
        manager.save(5, state)
    print("SCRIPT END", flush=True)


if __name__ == "__main__":
    main()
