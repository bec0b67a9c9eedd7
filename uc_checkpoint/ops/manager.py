"""Step-numbered checkpoints under one root: save, find the newest good one, load, keep a few.

:class:`CheckpointManager` is what a resume-after-preemption training script talks to::

    manager = CheckpointManager("s3://bucket/run1", keep_last=3)
    step = manager.load(state) if manager.latest() is not None else 0   # every rank
    for step in range(step + 1, steps + 1):
        train_step()
        if step % save_every == 0:
            manager.save(step, state)        # async: returns once the state is staged in memory
    manager.wait()

With ``CheckpointManager(..., async_staging=True)`` :meth:`~CheckpointManager.save` returns before
the copy is taken, and the loop must call :meth:`~CheckpointManager.wait_until_staged` before it
changes the state (``optimizer.step()``); the manager calls it itself before its next save, load or
wait, and a state changed too early fails the save instead of publishing a mixed checkpoint.

Layout under the root: ``step_<8 digits>/`` per checkpoint (a :class:`UCVolumeWriter` location:
data files and, once complete, ``.metadata``) and a ``latest`` pointer file for tools.

The policies the manager applies are pure functions of their own modules: which checkpoints
retention deletes (:mod:`uc_checkpoint.ops.retention`), the preemption flag
(:mod:`uc_checkpoint.ops.preemption`), the writer's and reader's settings
(:mod:`uc_checkpoint.ops.options`) and rollbacks (:mod:`uc_checkpoint.ops.lineage`).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from uc_checkpoint.dcp import exit_guard, metadata_io
from uc_checkpoint.dcp.buffers import StagingBuffers
from uc_checkpoint.dcp.planner import UCSavePlanner
from uc_checkpoint.dcp.reader import UCVolumeReader
from uc_checkpoint.dcp.stager import BackgroundStager
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.engine.listing import checkpoint_files, remove_empty_spread_dirs
from uc_checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RemoteRankError,
    TransferError,
    VolumeError,
    one_line,
    portable_error,
    rebuild_error,
)
from uc_checkpoint.format.layout import ABANDONED_NAME, METADATA_NAME
from uc_checkpoint.observability import SaveEvent, active_mlflow_run_id, log_to_mlflow
from uc_checkpoint.ops import catalog, lineage
from uc_checkpoint.ops.catalog import checkpoint_name
from uc_checkpoint.ops.options import ReaderOptions, WriterOptions
from uc_checkpoint.ops.preemption import PreemptionNotice, any_rank
from uc_checkpoint.ops.retention import steps_to_delete
from uc_checkpoint.volumes import Volume, open_volume

logger = logging.getLogger(__name__)

#: Name of the pointer file under the root: JSON ``{"step", "name", "location", "time"}``.
POINTER_NAME = "latest"

T = TypeVar("T")


#: One step location under the root (the catalog's record; :meth:`CheckpointManager.list` fills
#: ``step``, ``name``, ``published``; whether the checkpoint is also intact is what
#: :meth:`CheckpointManager.latest` checks).
CheckpointInfo = catalog.CheckpointInfo


class CheckpointManager:
    """Saves, finds, loads and prunes the step-numbered checkpoints under ``root``.

        Args:
            root: a path, ``file://``, ``s3://bucket/prefix`` or other fsspec URL, or a :class:`Volume`.
            keep_last: published checkpoints to keep (newest first); ``None`` keeps all. Older ones are
                deleted only after a newer save is published, never the location a save is writing.
            keep_every: also keep every checkpoint whose step is a multiple of this (e.g. for evals).
            async_save: :meth:`save` uses ``dcp.async_save`` (training resumes once the state is copied
                to CPU memory) rather than ``dcp.save``.
            async_mode: ``"thread"`` or ``"process"`` (DCP's ``AsyncCheckpointerType``).
            async_staging: copy the state to CPU memory in a background thread as well
                (:class:`~uc_checkpoint.dcp.stager.BackgroundStager`), so that :meth:`save` returns
                after a few milliseconds instead of after one copy of the state. Off by default
                because it moves a duty to the training loop: call :meth:`wait_until_staged` after
                :meth:`save` and before anything changes the state (``optimizer.step()``, a load
                into it). A state changed earlier fails the save
                (:class:`~uc_checkpoint.errors.StateChangedWhileStagingError`) rather than publish a
                checkpoint that mixes two steps. Needs ``async_save=True``.
            reuse_staging_buffers: keep the CPU copy of the state between async saves and copy the
                next save's state into it (:class:`~uc_checkpoint.dcp.buffers.StagingBuffers`):
                :meth:`save` blocks for a copy into memory already mapped rather than new memory
                (the kept-buffer rows of docs/benchmarks.md: about a third of an in-memory copy's
                time in its latest run), and the copy of the rank's
                state stays allocated between saves (it exists during each async save anyway).
                Needs ``async_save=True``, ``async_staging=False`` and ``async_mode="thread"`` (in
                PROCESS mode each snapshot goes to DCP's daemon with its save: nothing to keep).
            process_group: the ranks that save and load together (default: every rank). The manager
                never issues a collective on this group itself: on first use it creates two gloo groups
                over the same ranks, one for DCP's saves (whose collectives run in a background thread
                while training goes on) and one for what the training thread agrees on
                (:meth:`latest`, :meth:`list`, :meth:`preemption_requested`, :meth:`load`), so a save in
                flight can never pair its collectives with the training loop's or the manager's own.
            staging_dir: local staging root for writer and reader (default: ``$UC_CHECKPOINT_STAGING_DIR``
                or the system temp dir).
            list_attempts: attempts at listing the root before an error is raised (backoff doubling from
                ``list_backoff_s`` seconds, at most 10 s). A listing error is never taken for "no
                checkpoint": that would silently restart training from scratch.
            list_backoff_s: first retry delay in seconds.
            write_pointer: write the ``latest`` pointer file after each published save.
            writer_options, reader_options: settings of the :class:`UCVolumeWriter` each save creates
                and the :class:`UCVolumeReader` each load creates: a
                :class:`~uc_checkpoint.ops.options.WriterOptions` /
                :class:`~uc_checkpoint.ops.options.ReaderOptions` or a dict of their fields (its
                fields and units are documented there). Checked here, once: an unknown key or a bad
                value raises ``TypeError`` / ``ValueError`` naming it.
            volume_options: options for the root's volume when ``root`` is a path or URL (S3 endpoint,
                addressing style, checksums, part size, ...; see :func:`uc_checkpoint.volumes.open_volume`);
                every checkpoint under the root gets them.

        Rank 0 of the group lists, validates and prunes; the others receive its answers. A failure on
        rank 0 is raised on every rank as the same exception class with the same message (so no rank
        waits forever, and an ``except`` clause matches alike everywhere); a failure outside
        :mod:`uc_checkpoint.errors`' hierarchy is a :class:`~uc_checkpoint.errors.RemoteRankError` on
        every rank. Not thread-safe: call it from the training loop, on every rank, in the same order
        (each call that agrees across ranks is a collective on the manager's own foreground group).

        Length (about 320 lines of code, over the ~250 the package aims at): this is the one object a
    training script talks to, and its public methods carry their contract (ranks, errors, units)
    in docstrings. The decisions live elsewhere: what exists and which is latest in
    :mod:`uc_checkpoint.ops.catalog`, which checkpoints to delete in :mod:`uc_checkpoint.ops.retention`,
    rollback markers in :mod:`uc_checkpoint.ops.lineage`, the preemption flag and the settings in
    :mod:`uc_checkpoint.ops.preemption` / :mod:`uc_checkpoint.ops.options`, how ranks agree in
    ``_RankGroup`` below. What stays is the order of those calls around a save: the rollback check
    before the first one (``_check_rollback``), the record, pointer and retention after each.
    """

    def __init__(
        self,
        root: str | Volume,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        async_mode: str = "thread",
        async_staging: bool = False,
        reuse_staging_buffers: bool = False,
        process_group: dist.ProcessGroup | None = None,
        staging_dir: str | None = None,
        list_attempts: int = 5,
        list_backoff_s: float = 1.0,
        write_pointer: bool = True,
        writer_options: WriterOptions | Mapping[str, Any] | None = None,
        reader_options: ReaderOptions | Mapping[str, Any] | None = None,
        volume_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(root, (str, os.PathLike, Volume)):
            raise TypeError(f"root must be a path, URL or Volume, got {type(root).__name__}")
        for arg, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"{arg} must be an int or None, got {type(value).__name__}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        if async_mode not in ("thread", "process"):
            raise ValueError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")
        if async_staging and not async_save:
            raise ValueError("async_staging=True needs async_save=True (a synchronous save stages nothing)")
        if reuse_staging_buffers and (not async_save or async_staging or async_mode != "thread"):
            raise ValueError(
                "reuse_staging_buffers=True needs async_save=True, async_staging=False and async_mode='thread' "
                "(it keeps the writer's own staging copy, which PROCESS mode hands to DCP's daemon)"
            )
        if list_attempts < 1:
            raise ValueError(f"list_attempts must be >= 1, got {list_attempts}")
        #: Settings of each save's writer and each load's reader (they read as dicts too).
        # Checked once here; kept as plain dicts, as before, so code that adjusts them between
        # saves keeps working.
        self.writer_options: dict[str, Any] = dict(WriterOptions.coerce(writer_options))
        self.reader_options: dict[str, Any] = dict(ReaderOptions.coerce(reader_options))
        self.root = open_volume(root, **(volume_options or {}))
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.async_mode = async_mode
        self.async_staging = async_staging
        self._staging_buffers = StagingBuffers() if reuse_staging_buffers else None
        self.process_group = process_group
        self.staging_dir = staging_dir
        self.list_attempts = list_attempts
        self.list_backoff_s = list_backoff_s
        self.write_pointer = write_pointer
        self._inflight: tuple[int, Future] | None = None
        # The staging of the save in flight, while async staging may still be reading the state.
        self._staging: Future | None = None
        #: The :class:`~uc_checkpoint.observability.SaveEvent` of the last save (None before the first).
        self.last_save: SaveEvent | None = None
        self._preemption = PreemptionNotice()
        self._ranks = _RankGroup(process_group)
        # Lineage (see uc_checkpoint.ops.lineage): the step this manager loaded, whether its first save
        # checked for a rollback, and the steps known to be abandoned (rank 0).
        self._resumed_from: int | None = None
        self._lineage_checked = False
        self._abandoned: set[int] = set()

    # ------------------------------------------------------------------ ranks

    def _on_leader(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 of the group; every rank gets its result or the same error."""
        return self._ranks.on_leader(f"{what} under {self.root.url}", fn)

    # ------------------------------------------------------------------ listing

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried on :class:`TransferError` (:func:`_retry_transfers`).

        Raises:
            VolumeError: still failing after ``list_attempts`` attempts (the TransferError is its
                cause); other errors of ``fn`` are raised at once.
        """
        return _retry_transfers(f"{what} under {self.root.url}", fn, self.list_attempts, self.list_backoff_s)

    def _list_local(self) -> builtins.list[CheckpointInfo]:
        return self._retry("list checkpoints", lambda: catalog.list_steps(self.root))

    def _list_steps(self) -> builtins.list[CheckpointInfo]:
        """The root's one listing, ``published`` not looked up yet (see :meth:`_published`)."""
        return self._retry("list checkpoints", lambda: catalog.list_steps(self.root, published=False))

    def _published(self, info: CheckpointInfo) -> bool:
        """Whether ``info``'s ``.metadata`` exists (one lookup when the listing did not say)."""
        return bool(catalog.is_published(self.root, info, self._retry).published)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every step location under the root, oldest first (published or not), as the root shows
        it now: a save of this manager still in flight is missing or listed as unpublished until it
        is published (call :meth:`wait` first to list it; :meth:`load` waits for it itself).

        Raises:
            VolumeError: the root cannot be listed (after ``list_attempts`` attempts) or is unusable.
        """
        return self._on_leader("list checkpoints", self._list_local)

    def _inspect(self, info: CheckpointInfo) -> CheckpointInfo:
        """``info`` inspected by the catalog (:func:`uc_checkpoint.ops.catalog.inspect_step`): its
        ``.metadata`` loads, every data file it references is there with its recorded size, and no
        rollback abandoned it (:mod:`uc_checkpoint.ops.lineage`). Records the step as abandoned or not
        whenever its marker was looked at.

        Only evidence of damage makes a problem: a missing or short file, a ``.metadata`` that is
        undecodable or unsafe (:class:`CorruptCheckpointError`), or one that vanished since the
        listing (no longer published). A store that fails to answer proves nothing about the
        checkpoint, so its errors are retried and then raised, never reported as a problem.

        Raises:
            VolumeError: the ``.metadata`` cannot be read or the location cannot be listed after
                ``list_attempts`` attempts, or the store is unusable.
        """
        allow_unsafe = bool(self.reader_options.get("allow_unsafe_metadata", False))
        checked = catalog.inspect_step(
            self.root, info, retry=self._retry, allow_unsafe=allow_unsafe, rollback_first=True
        )
        if checked.abandoned:
            self._abandoned.add(info.step)
        elif checked.abandoned is not None:
            self._abandoned.discard(info.step)  # taken back, or saved again since
        return checked

    def _problem(self, info: CheckpointInfo) -> str | None:
        """Why the published checkpoint ``info`` cannot be loaded or must not be resumed, or None
        when it looks intact (see :meth:`_inspect`)."""
        return self._inspect(info).problem

    def _skipped(self, info: CheckpointInfo) -> None:
        log = logger.info if info.step in self._abandoned else logger.warning
        log("checkpoint manager: skipping checkpoint %s: %s", self.root.url_of(info.name), info.problem)

    def _latest_local(self) -> int | None:
        found = catalog.latest(self.root, infos=self._list_steps(), check=self._inspect, on_skip=self._skipped)
        return None if found is None else found.step

    def latest(self) -> int | None:
        """Step of the newest checkpoint that is published and intact (``.metadata`` loads, every
        data file it references exists with its recorded size), or None when there is none. Broken
        newer ones are skipped with a warning; ones a rollback abandoned (see :meth:`save`) are
        skipped too. Rank 0 decides; every rank gets the same answer.

        Published checkpoints only: a save of this manager still in flight does not count until it
        is published, so right after an async :meth:`save` this may still name the previous step
        (or None). Call :meth:`wait` first to include it; :meth:`load` waits for it itself.

        Raises:
            VolumeError: the root, a checkpoint's location or its ``.metadata`` cannot be read after
                ``list_attempts`` attempts, or the store is unusable (a store error is never taken
                for "no checkpoint" or "broken": that would silently resume from an older step).
        """
        return self._on_leader("find the latest checkpoint", self._latest_local)

    # ------------------------------------------------------------------ save

    def save(self, step: int, state_dict: dict[str, Any]) -> Future:
        """Save ``state_dict`` as the checkpoint of ``step`` (every rank calls it).

        Waits for the previous save first (one save in flight) and raises its error, if any. With
        ``async_save`` the returned future completes when the checkpoint is published (``.metadata``
        written); otherwise the save is done when this returns.

        When it returns, the state may change: the save works on its own copy; except with
        ``async_staging=True``, where the copy is still being taken: call :meth:`wait_until_staged`
        before anything changes the state (the next ``optimizer.step()``)::

            manager.save(step, state)
            loss.backward()                 # overlaps the copy
            manager.wait_until_staged()     # then the parameters may change
            optimizer.step()

        After a publish, rank 0 writes the ``latest`` pointer and prunes old checkpoints (in the
        background for async saves; failures there are logged, never raised into training).

        Rollbacks: the first save of this manager below published steps (the run was resumed from
        an older checkpoint, e.g. ``load(state, step=100)`` after a loss spike, or started afresh)
        marks those newer checkpoints as an abandoned branch, with a warning: :meth:`latest` skips
        them and retention deletes them before any checkpoint of the current line. Loading an
        abandoned step and saving from it takes it back. See :mod:`uc_checkpoint.ops.lineage`.

        Raises:
            TypeError: ``step`` is not an int.
            ValueError: ``step`` is negative.
            CheckpointException (DCP's) with our errors inside: the previous or this (sync) save failed.
        """
        return self._save(step, state_dict, asynchronous=self.async_save)

    def wait_until_staged(self, timeout: float | None = None) -> None:
        """Block until the save in flight no longer reads the state passed to :meth:`save`; from
        then on the training loop may change it in place. Returns at once when no staging is in
        progress (no save in flight, a synchronous save, ``async_staging=False``, or already
        waited for); cheap enough to call before every ``optimizer.step()``.

        A staging that failed is not raised here (the state is free either way): like every save
        error it is raised by :meth:`wait` or the next :meth:`save`. :meth:`save`, :meth:`load`,
        :meth:`wait` and :meth:`save_final` call this themselves first.

        Args:
            timeout: seconds to wait at most; None waits as long as the copy takes.

        Raises:
            TimeoutError: the copy was not complete after ``timeout`` seconds (the state must still
                not change; call again).
        """
        staging, self._staging = self._staging, None
        if staging is None:
            return
        try:
            futures_wait([staging], timeout=timeout)
        finally:
            if not staging.done():
                self._staging = staging
        if not staging.done():
            raise TimeoutError(f"the staging of the save in flight took more than {timeout} s")

    def _save(self, step: int, state_dict: dict[str, Any], *, asynchronous: bool) -> Future:
        """:meth:`save`, with ``dcp.async_save`` or ``dcp.save`` as ``asynchronous`` says."""
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        name = checkpoint_name(step)
        self.wait()  # also the staging of the previous save
        if not self._lineage_checked:
            self._on_leader("check for a rollback", lambda: self._check_rollback(step))
            self._lineage_checked = True
        location = self.root.child(name)
        writer = UCVolumeWriter(
            location, staging_dir=self.staging_dir, staging_buffers=self._staging_buffers, **self.writer_options
        )
        leader = self._ranks.is_leader()
        run_id = active_mlflow_run_id() if leader else None
        group = self._ranks.save_group()
        pending = _PendingSave(step, location.url, leader, run_id, asynchronous)  # starts the clock
        try:
            fut, staging = self._start_save(state_dict, writer, group, asynchronous)
        except BaseException as exc:
            self._record(SaveEvent(step, location.url, pending.elapsed_s(), error=one_line(exc)), pending)
            raise
        pending.blocked_s = pending.elapsed_s()
        self._inflight = (step, pending.done)
        if staging is not None:
            self._staging = staging
            staging.add_done_callback(partial(_staged, pending))
        fut.add_done_callback(partial(self._on_saved, pending))
        if asynchronous:
            # A script may end right after an async save: the interpreter's exit waits for it.
            exit_guard.watch_future(pending.done, location.url)
        return pending.done

    def _start_save(
        self, state_dict: dict[str, Any], writer: UCVolumeWriter, group: dist.ProcessGroup | None, asynchronous: bool
    ) -> tuple[Future, Future | None]:
        """Start DCP's save: a future of its ``Metadata`` (already complete for a sync save) and,
        with async staging, the future of the staged copy."""
        common: dict[str, Any] = {"storage_writer": writer, "process_group": group, "planner": UCSavePlanner()}
        if asynchronous:
            mode = AsyncCheckpointerType.PROCESS if self.async_mode == "process" else AsyncCheckpointerType.THREAD
            if self.async_staging:
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

    def _on_saved(self, pending: _PendingSave, fut: Future) -> None:
        """DCP's future ``fut`` completed: record the save, run rank 0's housekeeping, then complete
        the caller's future (so that :meth:`wait` covers the housekeeping too)."""
        try:
            self._record(_save_event(pending, fut), pending)
        except Exception:  # noqa: BLE001 - a record must never leave wait() blocked
            logger.exception("checkpoint manager: recording the save of step %d failed", pending.step)
        if pending.leader:
            self._after_publish(pending.step, fut)  # logs its own failures
        _relay(fut, pending.done)

    def _check_rollback(self, step: int) -> builtins.list[int]:
        """Rank 0, before this manager's first save: mark the published steps above ``step`` as
        abandoned, and take back the step this manager resumed from if it was abandoned; returns
        the steps abandoned now."""
        infos = self._list_steps()
        resumed = self._resumed_from
        self._abandoned.discard(step)  # saved again now, on this line
        if resumed is not None:
            self._abandoned.discard(resumed)
            location = self.root.child(checkpoint_name(resumed))
            if location.size(ABANDONED_NAME) is not None:
                try:
                    location.delete(ABANDONED_NAME)
                except TransferError as exc:  # a mount that refuses deletes: newer saves win anyway
                    logger.warning("checkpoint manager: could not take back step %d (%s)", resumed, exc)
                else:
                    logger.warning(
                        "checkpoint manager: step %d, abandoned by an earlier rollback, was loaded and "
                        "is saved from: it is part of the run's line again",
                        resumed,
                    )
        newer = lineage.newer_published([i.step for i in infos if i.step > step and self._published(i)], step)
        marked = []
        for old in newer:
            if old == resumed:
                continue
            location = self.root.child(checkpoint_name(old))
            try:
                metadata = self._retry(f"read {location.url}", partial(self._read_metadata, location))
                manifest = metadata_io.manifest_of(metadata)
            except (CorruptCheckpointError, CheckpointNotFoundError):
                continue  # broken or gone: latest() skips it anyway
            self._abandoned.add(old)
            if lineage.abandonment_of(location, manifest, location.list_files()) is not None:
                continue  # an earlier rollback's marker still says so (and some mounts refuse rewrites)
            location.publish_bytes(
                ABANDONED_NAME,
                lineage.abandonment_marker((manifest or {}).get("save_id"), step, resumed),
                overwrite=True,
            )
            marked.append(old)
        if marked:
            logger.warning(
                "checkpoint manager: saving step %d under %s, below published step(s) %s: treating this as a "
                "rollback. Those checkpoints are now an abandoned branch (a %s file in each): latest() skips "
                "them and retention deletes them first. To return to one, load it with load(state, step=N) "
                "and save from it.",
                step,
                self.root.url,
                marked,
                ABANDONED_NAME,
            )
        return marked

    def _record(self, event: SaveEvent, pending: _PendingSave) -> None:
        self.last_save = event
        if event.ok:
            staged = "" if pending.staged_s is None else f", staged after {pending.staged_s:.3f} s"
            logger.info(
                "checkpoint step %d: %s bytes in %s files to %s; blocked %.3f s%s, published after %.3f s",
                event.step,
                event.bytes,
                event.files,
                event.location,
                event.blocked_s,
                staged,
                event.publish_s,
            )
        elif pending.asynchronous:
            # Raised again by the next save() or wait(), but a script may never call either.
            logger.error("checkpoint step %d: the save to %s failed: %s", event.step, event.location, event.error)
        if pending.mlflow_run_id is not None:
            log_to_mlflow(pending.mlflow_run_id, event)

    def wait(self) -> None:
        """Wait for the save in flight, if any (its staging, upload, publish and housekeeping);
        raise its error. A save's error is raised once: the next call returns at once.
        :meth:`save`, :meth:`load` and :meth:`save_final` call this (or, for the last, its bounded
        form) themselves first.

        Raises:
            CheckpointException (DCP's, a ``BaseException``) with our errors inside: the save failed.
        """
        self.wait_until_staged()
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight[1].result()

    def _after_publish(self, step: int, fut: Future) -> None:
        """Housekeeping on rank 0 after ``step`` was published: the ``latest`` pointer, then
        retention. Each runs whatever happened to the other (a mount that refuses to replace the
        pointer must not stop old checkpoints from being deleted, nor the reverse); a failure is
        logged with the step and location, never raised into training."""
        if fut.cancelled() or fut.exception() is not None:
            return  # nothing published: keep everything
        # One listing serves both; without it neither can run safely (the pointer could move back to
        # an older step, retention could not tell what exists).
        infos = self._housekeeping(step, "listing the checkpoints", self._list_steps)
        if infos is None:
            return
        # The pointer names the newest checkpoint of the run's line: saving an older step again must
        # not move it back (abandoned steps do not count). Only steps above this one can say so,
        # usually none: the housekeeping's requests do not grow with the checkpoints kept.
        newer = [i for i in infos if i.step > step and i.step not in self._abandoned]
        if self.write_pointer and not any(self._published(i) for i in newer):
            self._housekeeping(step, f"writing the {POINTER_NAME} pointer", lambda: self.write_latest_pointer(step))
        self._housekeeping(step, "retention (deleting old checkpoints)", lambda: self._prune(infos, protect={step}))

    def _housekeeping(self, step: int, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None after logging its failure (housekeeping must not take training down)."""
        try:
            return fn()
        except Exception:  # noqa: BLE001 - logged with its traceback; the other steps still run
            logger.exception(
                "checkpoint manager: after publishing step %d under %s: %s failed", step, self.root.url, what
            )
            return None

    def write_latest_pointer(self, step: int) -> None:
        """Write the ``latest`` pointer file (one whole-file write, no symlink: FUSE mounts often lack
        them): ``{"step": int, "name": "step_...", "location": URL, "time": unix seconds}``. Tools
        may read it; :meth:`latest` does not trust it and lists instead."""
        name = checkpoint_name(step)
        body = {"step": step, "name": name, "location": self.root.url_of(name), "time": time.time()}
        self.root.publish_bytes(POINTER_NAME, (json.dumps(body) + "\n").encode(), overwrite=True)

    def read_latest_pointer(self) -> dict[str, Any] | None:
        """The ``latest`` pointer's content, or None when there is none or it is unreadable."""
        raw = self.root.read_bytes(POINTER_NAME)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    # ------------------------------------------------------------------ retention

    def prune(self, protect: set[int] | frozenset[int] = frozenset()) -> builtins.list[int]:
        """Delete published checkpoints beyond the retention policy; returns the deleted steps.

        Kept: the ``keep_last`` newest published checkpoints, steps that are multiples of
        ``keep_every``, ``protect``, the save in flight, and everything newer than the oldest kept
        checkpoint (unpublished locations are left to garbage collection). After a rollback,
        abandoned checkpoints count as older than every checkpoint of the run's current line
        (:func:`uc_checkpoint.ops.retention.steps_to_delete`). A checkpoint is unpublished
        first (``.metadata`` deleted), then its data files: a crash midway leaves an unpublished
        location, never a published one with missing files. Call on one rank only (the manager
        calls it on rank 0 after each publish).
        """
        return self._prune(self._list_steps(), protect)

    def _prune(self, infos: builtins.list[CheckpointInfo], protect: set[int] | frozenset[int]) -> builtins.list[int]:
        """Retention over ``infos`` (a listing, ``published`` looked up or not): whether a location
        is published is looked up only where it decides something, newest first until
        ``keep_last`` published ones are found, then for each older deletion candidate; so a save's
        housekeeping costs requests in proportion to what it deletes, not to what is kept."""
        if self.keep_last is None:
            return []
        keep = set(protect)
        if self._inflight is not None:
            keep.add(self._inflight[0])
        # Only steps above the one just saved can belong to an abandoned branch this manager has not
        # seen yet (another run's rollback): usually none, so this costs no request.
        above = max(protect, default=None)
        for info in infos:
            if above is not None and info.step > above and info.step not in self._abandoned and self._published(info):
                self._problem(info)  # records the step as abandoned when its marker applies
        # Newest first in the policy's order (the current line above an abandoned branch).
        ranked = sorted(infos, key=lambda i: (i.step not in self._abandoned, i.step), reverse=True)
        published: builtins.list[CheckpointInfo] = []
        newest = 0
        for info in ranked:
            if newest < self.keep_last:
                if self._published(info):
                    published.append(info)
                    newest += 1
            elif info.step in keep or (self.keep_every and info.step % self.keep_every == 0):
                published.append(info)  # kept whatever it is: no need to look
            elif self._published(info):
                published.append(info)
        plan = steps_to_delete(
            [i.step for i in published],
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            protect=keep,
            abandoned=self._abandoned,
        )
        by_step = {i.step: i for i in published}
        for step in plan:
            self._delete_checkpoint(by_step[step])
        if plan:
            logger.info(
                "checkpoint manager: deleted checkpoints %s under %s (keep_last=%s, keep_every=%s)",
                plan,
                self.root.url,
                self.keep_last,
                self.keep_every,
            )
        return plan

    def _delete_checkpoint(self, info: CheckpointInfo) -> None:
        location = self.root.child(info.name)
        location.delete(METADATA_NAME)  # unpublish first
        names = [name for name, size in checkpoint_files(location).items() if size >= 0]  # spread prefixes too
        for name in names:
            location.delete(name)
        remove_empty_spread_dirs(location, names)
        location.remove_if_empty()

    # ------------------------------------------------------------------ preemption

    def enable_preemption_save(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """Opt in: on ``signals`` (SIGTERM by default, what schedulers and spot/preemptible VMs send
        before a kill) only a flag is set; the training loop polls :meth:`preemption_requested` at a
        step boundary and calls :meth:`save_final`. Nothing is saved from inside the signal handler
        (collectives and file I/O are not safe there). Call from the main thread. The previous
        handlers are restored by :meth:`disable_preemption_save`. See
        :mod:`uc_checkpoint.ops.preemption`.
        """
        self._preemption.install(signals)

    def disable_preemption_save(self) -> None:
        """Restore the signal handlers :meth:`enable_preemption_save` replaced."""
        self._preemption.uninstall()

    def preemption_requested(self) -> bool:
        """Whether any rank received a preemption signal. With several ranks this is a collective
        (an all-reduce over the group): every rank must call it at the same step, and all get the
        same answer, so that they stop and save together."""
        if not self._ranks.distributed():
            return self._preemption.received
        return any_rank(self._preemption.received, self._ranks.agree_group())

    def save_final(self, step: int, state_dict: dict[str, Any], budget_s: float = 60.0) -> bool:
        """The last checkpoint before a preemption: wait for the save in flight, then save ``step``
        synchronously (every rank calls it). Returns True when it was published.

        ``budget_s`` (seconds) bounds the wait for the save in flight: if that save has not finished
        by then, no new save is started (it could not finish either) and False is returned; the
        save in flight may still land. A final save that itself runs past the budget is logged;
        DCP cannot abandon a save midway, and stopping one would only leave an unpublished location.

        Raises:
            CheckpointException (DCP's): the final save failed.
        """
        deadline = time.monotonic() + budget_s
        self.wait_until_staged()  # a copy is a few seconds at most; the state is needed right after
        inflight, self._inflight = self._inflight, None
        landed = False
        if inflight is not None:
            try:
                inflight[1].result(timeout=max(0.0, deadline - time.monotonic()))
                landed = True
            except FutureTimeout:
                self._inflight = inflight
                logger.error(
                    "checkpoint manager: the save of step %d did not finish within %.0f s; no final save",
                    inflight[0],
                    budget_s,
                )
                return False
            except Exception as exc:  # noqa: BLE001 - the final save below supersedes it
                logger.warning(
                    "checkpoint manager: the save of step %d failed (%s); taking the final save", inflight[0], exc
                )
        if landed and inflight is not None and inflight[0] == step:
            return True  # this step is already saved
        started = time.monotonic()
        self._save(step, state_dict, asynchronous=False)
        self.wait()
        took = time.monotonic() - started
        if time.monotonic() > deadline:
            logger.warning(
                "checkpoint manager: final save of step %d took %.1f s, past the %.0f s budget", step, took, budget_s
            )
        else:
            logger.info("checkpoint manager: final save of step %d published in %.1f s", step, took)
        return True

    # ------------------------------------------------------------------ load

    def _read_metadata(self, location: Volume) -> Any:
        """The checkpoint's decoded ``.metadata`` (:func:`uc_checkpoint.dcp.metadata_io.read_metadata`),
        trusting what the reader options trust."""
        unsafe = bool(self.reader_options.get("allow_unsafe_metadata", False))
        return metadata_io.read_metadata(location, allow_unsafe=unsafe)

    def _metadata_exists(self, location: Volume) -> bool:
        """Whether ``location`` has a ``.metadata``: one size lookup, and when that finds nothing, one
        listing of ``location`` (each retried on TransferError).

        Raises:
            VolumeError: either request still fails, or the store is unusable (a missing bucket).
        """
        what = f"look up {location.url_of(METADATA_NAME)}"
        if self._retry(what, lambda: location.size(METADATA_NAME)) is not None:
            return True
        # S3 answers a HEAD of a key in a missing bucket with a bare 404, as for a missing key (a
        # HEAD answer has no body to name the error); a listing tells the two apart.
        return METADATA_NAME in self._retry(what, location.list_files)

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> int:
        """Load the checkpoint of ``step`` (default: :meth:`latest`) into ``state_dict`` in place, on
        every rank (DCP reshards to this run's world size). Returns the step loaded. A given
        ``step`` costs one lookup of its ``.metadata`` first (a HEAD on object stores, by rank 0; a
        listing of the step's location too when the HEAD finds nothing).

        First it waits for this manager's own save in flight, as :meth:`wait` does (its staging,
        upload, publish and housekeeping, however long they take) and raises that save's error if
        it failed; only then is the step resolved. So a load right after an async :meth:`save`
        loads that save's step, never an older one (:meth:`latest` alone reports published
        checkpoints only). Saves by other processes are not waited for: the root shows what they
        have published.

        Raises:
            CheckpointNotFoundError: no intact published checkpoint (``step=None``), or nothing
                published at ``step`` (never saved, unfinished or deleted), raised as itself.
            VolumeError: the root or the step's ``.metadata`` cannot be read (after
                ``list_attempts`` attempts).
            CheckpointException (DCP's, a ``BaseException``) with our errors inside: this manager's
                save in flight failed (raised once, as by :meth:`wait`; nothing is loaded), or the
                load failed, including a checkpoint deleted between the lookup and the load.
        """
        self.wait()  # also its staging: the load writes into tensors it may still be copying
        explicit = step is not None
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(f"no published checkpoint under {self.root.url}")
        location = self.root.child(checkpoint_name(step))
        # DCP would raise our error wrapped in its CheckpointException (a BaseException): a caller's
        # ``except CheckpointNotFoundError`` must see a missing step as such.
        if explicit and not self._on_leader(f"look up step {step}", lambda: self._metadata_exists(location)):
            raise CheckpointNotFoundError(
                f"no published checkpoint at step {step}: {location.url_of(METADATA_NAME)} does not exist"
            )
        reader = UCVolumeReader(location, staging_dir=self.staging_dir, **self.reader_options)
        dcp.load(state_dict, storage_reader=reader, process_group=self._ranks.agree_group())
        self._resumed_from = step
        return step


__all__ = ["POINTER_NAME", "CheckpointInfo", "CheckpointManager"]


@dataclass
class _PendingSave:
    """One save between its start and its publish: what its done-callback needs."""

    step: int
    location: str
    leader: bool  # rank 0 of the group: runs the housekeeping
    mlflow_run_id: str | None
    asynchronous: bool
    started: float = field(default_factory=time.perf_counter)  # perf_counter seconds
    blocked_s: float = 0.0  # how long save() kept the training loop
    staged_s: float | None = None  # until the staged copy was complete (async staging)
    done: Future = field(default_factory=Future)  # the caller's: completes after the housekeeping

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


def _staged(pending: _PendingSave, staging: Future) -> None:
    """The async staging of ``pending`` ended (the copy is complete, or failed)."""
    pending.staged_s = pending.elapsed_s()
    logger.debug("checkpoint step %d: staged after %.3f s", pending.step, pending.staged_s)


def _save_event(pending: _PendingSave, fut: Future) -> SaveEvent:
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


def _relay(source: Future, target: Future) -> None:
    """Complete ``target`` as ``source`` completed (never leave :meth:`CheckpointManager.wait`
    blocked on a future nobody will complete)."""
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def _retry_transfers(what: str, fn: Callable[[], T], attempts: int, backoff_s: float) -> T:
    """``fn()``, retried on :class:`TransferError`: ``attempts`` attempts in all, the delay doubling
    from ``backoff_s`` seconds up to 10 s.

    Raises:
        VolumeError: still failing after the last attempt (the TransferError is its cause); other
            errors of ``fn`` are raised at once.
    """
    delay = backoff_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TransferError as exc:
            # Throttling and network errors (already retried by the store's client). A missing
            # bucket or a root that is a file is a VolumeError and not worth retrying.
            if attempt == attempts:
                raise VolumeError(f"cannot {what} after {attempt} attempts: {exc}") from exc
            logger.warning(
                "checkpoint manager: %s failed (attempt %d of %d), retrying in %.1f s: %s",
                what,
                attempt,
                attempts,
                delay,
                exc,
            )
            time.sleep(delay)
            delay = min(2 * delay, 10.0)
    raise AssertionError("unreachable")


class _RankGroup:
    """The ranks a :class:`CheckpointManager` works with, and how they agree.

    The manager never issues a collective on the caller's ``process_group`` itself: the first time
    one is needed, every rank of the group creates two gloo groups over the same ranks, one for
    DCP's saves (:meth:`save_group`) and one for what the training thread agrees on
    (:meth:`agree_group`). Why two, and why not the caller's group: DCP runs a save's collectives
    (plan gather, result gather, metadata broadcast) in its background thread while the training
    thread goes on issuing collectives of its own. Two threads issuing collectives on one group
    pair them in whatever order each rank happens to reach them, which deadlocks as soon as the
    ranks' orders differ. Background work gets a group nothing else uses; foreground agreement
    another. ``use_local_synchronization`` keeps ranks outside the group out of the call and leaves
    the default group's counter of group names alone, so the caller's own ``new_group`` calls stay
    in step on every rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self._pair: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (save, agree)

    def distributed(self) -> bool:
        """Whether more than one rank takes part (else every call is local)."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def is_leader(self) -> bool:
        """Rank 0 of the group, or the only process."""
        return not self.distributed() or dist.get_rank(self.process_group) == 0

    def _groups(self, index: int) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if not self.distributed():
            return self.process_group
        if self._pair is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self._pair = (
                dist.new_group(ranks, backend="gloo", use_local_synchronization=True, group_desc="uc_checkpoint_save"),
                dist.new_group(ranks, backend="gloo", use_local_synchronization=True, group_desc="uc_checkpoint_agree"),
            )
        return self._pair[index]

    def save_group(self) -> dist.ProcessGroup | None:
        """Group for DCP's saves (collectives in a background thread); None without a process group."""
        return self._groups(0)

    def agree_group(self) -> dist.ProcessGroup | None:
        """Group for collectives the training thread issues (agreement, loads)."""
        return self._groups(1)

    def on_leader(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 of the group and hand its result, or its failure, to every rank
        (a collective on :meth:`agree_group`; ``what`` names the operation in messages).

        A failure is raised on every rank as the same class with the same message: rank 0 raises
        its own exception; the others rebuild it from its class name and message
        (:func:`uc_checkpoint.errors.portable_error`), with a :class:`RemoteRankError` naming rank 0
        and ``what`` as its cause. A class outside our hierarchy (and the builtin errors that can
        be rebuilt) is a :class:`RemoteRankError` on every rank, rank 0 included.
        """
        if not self.distributed():
            return fn()
        box: list[Any] = [None]
        error: Exception | None = None
        if self.is_leader():
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                error = exc
                kind = type(exc).__qualname__
                kind = kind if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{kind}"
                box[0] = ("error", (portable_error(exc), kind, str(exc)))
        dist.broadcast_object_list(box, group=self.agree_group(), group_src=0)
        status, value = box[0]
        if status == "ok":
            return value
        portable, kind, message = value
        remote = RemoteRankError(f"rank 0 failed to {what}: {kind}: {message}", kind)
        if portable is None:
            raise remote from error
        if error is not None:
            raise error
        raise rebuild_error(*portable) from remote
