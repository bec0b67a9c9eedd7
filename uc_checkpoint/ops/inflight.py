"""The manager's save in flight: how it is started with DCP, what its completion records and logs.

:class:`PendingSave` is one save between :meth:`CheckpointManager.save
<uc_checkpoint.ops.manager.CheckpointManager.save>` and its publish; :func:`start_dcp_save` starts it
(``dcp.save`` or ``dcp.async_save``, with the manager's async staging when asked); when DCP's future
completes, :func:`save_event` and :func:`record` turn it into a
:class:`~uc_checkpoint.observability.SaveEvent` (log line, MLflow metrics) and :func:`relay` completes
the caller's future.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from uc_checkpoint.dcp import metadata_io
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.dcp.planner import UCSavePlanner
from uc_checkpoint.dcp.stager import BackgroundStager
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.errors import one_line
from uc_checkpoint.observability import SaveEvent, log_to_mlflow

logger = logging.getLogger(__name__)


@dataclass
class PendingSave:
    """One save between its start and its publish: what its done-callback needs.

    Attributes:
        step, location: the checkpoint's step and URL.
        leader: rank 0 of the group, which runs the housekeeping.
        mlflow_run_id: the MLflow run its metrics go to (None: none).
        asynchronous: started with ``dcp.async_save``.
        started: ``time.perf_counter()`` at the start, seconds.
        blocked_s: seconds :meth:`save` kept the training loop.
        staged_s: seconds until the staged copy was complete (async staging), else None.
        done: the caller's future, completed after the housekeeping.
    """

    step: int
    location: str
    leader: bool
    mlflow_run_id: str | None
    asynchronous: bool
    started: float = field(default_factory=time.perf_counter)
    blocked_s: float = 0.0
    staged_s: float | None = None
    done: Future = field(default_factory=Future)

    def elapsed_s(self) -> float:
        """Seconds since the save started."""
        return time.perf_counter() - self.started


def start_dcp_save(
    state_dict: dict[str, Any],
    writer: UCVolumeWriter,
    group: dist.ProcessGroup | None,
    *,
    asynchronous: bool,
    staging: Staging,
) -> tuple[Future, Future | None]:
    """Start DCP's save of ``state_dict`` through ``writer`` on ``group`` (``dcp.async_save`` in
    ``staging``'s mode when ``asynchronous``, else ``dcp.save``): a future of its ``Metadata``
    (already complete for a synchronous save) and, with ``staging.background_copy``, the future
    of the staged copy (:class:`~uc_checkpoint.dcp.stager.BackgroundStager`).

    Raises:
        what ``dcp.save`` / ``dcp.async_save`` raise (DCP's ``CheckpointException`` for a failed
        synchronous save).
    """
    common: dict[str, Any] = {"storage_writer": writer, "process_group": group, "planner": UCSavePlanner()}
    if asynchronous:
        mode = AsyncCheckpointerType.PROCESS if staging.mode == "process" else AsyncCheckpointerType.THREAD
        if staging.background_copy:
            response = dcp.async_save(
                state_dict, async_checkpointer_type=mode, async_stager=BackgroundStager(), **common
            )
            assert isinstance(response, AsyncSaveResponse)  # the stager returns a future
            return response.upload_completion, response.staging_completion
        fut = dcp.async_save(state_dict, async_checkpointer_type=mode, **common)
        assert isinstance(fut, Future)  # our writer stages synchronously: the copy is done
        return fut, None
    done: Future = Future()
    done.set_result(dcp.save(state_dict, **common))
    return done, None


def staged(pending: PendingSave, staging: Future) -> None:
    """The async staging of ``pending`` ended (the copy is complete, or failed)."""
    pending.staged_s = pending.elapsed_s()
    logger.debug("checkpoint step %d: staged after %.3f s", pending.step, pending.staged_s)


def save_event(pending: PendingSave, fut: Future) -> SaveEvent:
    """The :class:`SaveEvent` of a save whose DCP future ``fut`` has just completed."""
    event = SaveEvent(pending.step, pending.location, pending.blocked_s)
    if fut.cancelled():
        event.error = "cancelled"
    elif fut.exception() is not None:
        event.error = one_line(fut.exception())  # type: ignore[arg-type]
    else:
        event.publish_s = pending.elapsed_s()
        files = (metadata_io.manifest_of(fut.result()) or {}).get("files")
        if files:
            event.bytes, event.files = sum(int(e["size"]) for e in files.values()), len(files)
    return event


def record(event: SaveEvent, pending: PendingSave) -> None:
    """Log ``event`` (a failed async save at ERROR: a script may never call ``wait()``) and send it
    to ``pending``'s MLflow run, if any."""
    if event.ok:
        staged_after = "" if pending.staged_s is None else f", staged after {pending.staged_s:.3f} s"
        logger.info(
            "checkpoint step %d: %s bytes in %s files to %s; blocked %.3f s%s, published after %.3f s",
            event.step,
            event.bytes,
            event.files,
            event.location,
            event.blocked_s,
            staged_after,
            event.publish_s,
        )
    elif pending.asynchronous:
        logger.error("checkpoint step %d: the save to %s failed: %s", event.step, event.location, event.error)
    if pending.mlflow_run_id is not None:
        log_to_mlflow(pending.mlflow_run_id, event)


def relay(source: Future, target: Future) -> None:
    """Complete ``target`` as ``source`` completed (never leave the manager's ``wait()`` blocked on
    a future nobody will complete)."""
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


__all__ = ["PendingSave", "record", "relay", "save_event", "staged", "start_dcp_save"]
