"""Step-numbered checkpoints under one root: save, find the newest good one, load, keep a few.

:class:`CheckpointManager` is what a resume-after-preemption training script talks to (the
"Checkpoint manager" in docs/guide.md has the loop).

Layout under the root: ``step_<8 digits>/`` per checkpoint (a :class:`UCVolumeWriter` location:
data files and, once complete, ``.metadata``) and a ``latest`` pointer file for tools.

The policies the manager applies live in modules of their own: which checkpoints retention
deletes (:mod:`uc_checkpoint.ops.retention`), the preemption flag
(:mod:`uc_checkpoint.ops.preemption`), the writer's and reader's settings
(:mod:`uc_checkpoint.ops.options`), rollbacks (:mod:`uc_checkpoint.ops.lineage`), how the ranks
agree (:mod:`uc_checkpoint.ops.ranks`), how often to save (:mod:`uc_checkpoint.ops.interval`) and
what the root holds: its listing, intact checkpoints, retention's deletes
(:mod:`uc_checkpoint.ops.root_view`).
What stays here is the order of those calls around a save: the rollback check before the first
one, the record, pointer and retention after each (the save in flight:
:mod:`uc_checkpoint.ops.inflight`).
"""

from __future__ import annotations

import builtins
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from uc_checkpoint.dcp.buffers import StagingBuffers
from uc_checkpoint.dcp.options import ReaderOptions, Staging, WriterOptions
from uc_checkpoint.dcp.reader import UCVolumeReader
from uc_checkpoint.dcp.writer import UCVolumeWriter
from uc_checkpoint.errors import CheckpointNotFoundError, PeerTimeoutError, one_line
from uc_checkpoint.format.layout import METADATA_NAME, checkpoint_name
from uc_checkpoint.observability import SaveEvent, current_mlflow_run_id, recorded_mlflow_run_id
from uc_checkpoint.ops import catalog, inflight
from uc_checkpoint.ops.catalog import POINTER_NAME, CheckpointInfo
from uc_checkpoint.ops.interval import IntervalPolicy
from uc_checkpoint.ops.options import check_manager_arguments, check_timeout
from uc_checkpoint.ops.preemption import PreemptionNotice
from uc_checkpoint.ops.ranks import RankGroup
from uc_checkpoint.ops.root_view import RootView
from uc_checkpoint.ops.schedule import SaveSchedule
from uc_checkpoint.volumes import Volume, open_volume

logger = logging.getLogger(__name__)


T = TypeVar("T")


class CheckpointManager:
    """Saves, finds, loads and prunes the step-numbered checkpoints under ``root``.

    Args:
        root: a path, ``file://``, ``s3://bucket/prefix`` or other fsspec URL, or a :class:`Volume`.
        keep_last: published checkpoints to keep (newest first); ``None`` keeps all. Older ones are
            deleted only after a newer save is published, never the location a save is writing.
        keep_every: also keep every checkpoint whose step is a multiple of this (e.g. for evals).
        staging: how each save runs (:class:`~uc_checkpoint.dcp.options.Staging`): DCP's THREAD
            or PROCESS async save or a synchronous one, the copy to CPU memory in the background
            or not, its memory kept between saves or not. None: ``Staging()``, a THREAD-mode
            ``dcp.async_save`` (training resumes once the state is copied to CPU memory).
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
        writer, reader: settings of the :class:`UCVolumeWriter` each save creates and the
            :class:`UCVolumeReader` each load creates (:class:`~uc_checkpoint.dcp.options.WriterOptions`,
            :class:`~uc_checkpoint.dcp.options.ReaderOptions`, checked when built); None: the defaults.
        volume_options: options for the root's volume when ``root`` is a path or URL (S3 endpoint,
            addressing style, checksums, part size, ...; see :func:`uc_checkpoint.volumes.open_volume`);
            every checkpoint under the root gets them.
        save_interval: how often :meth:`should_save` says to save: an
            :class:`~uc_checkpoint.ops.interval.IntervalPolicy` (``EverySteps(n)``,
            ``EverySeconds(s)``, ``BlockedFraction(f)``, ``YoungDaly(mtbf_s=...)``, ...). None: the
            caller decides when to save.
        timeout: seconds (or a ``timedelta``) the manager waits for another rank in its
            collectives and store waits, in the training thread and in the save thread alike;
            None: the job's, the default group's timeout as ``init_process_group(timeout=...)``
            set it (also with a ``process_group`` made by ``new_group()``, which has torch's
            default, not the job's). A rank whose peer hangs gets a
            :class:`~uc_checkpoint.errors.PeerTimeoutError` after about this long, naming the
            operation and the peer; the manager is unusable afterwards (docs/operating.md,
            "A hung peer").

    MLflow: each save records the run it logs to (the active run, else ``MLFLOW_RUN_ID``) in the
    checkpoint's manifest; :attr:`resumed_mlflow_run_id` is the one of the checkpoint loaded (see
    :func:`uc_checkpoint.observability.resume_mlflow_run`).

    Rank 0 of the group lists, validates and prunes; the others receive its answers. A failure on
    rank 0 is raised on every rank as the same exception class with the same message (so no rank
    waits forever, and an ``except`` clause matches alike everywhere); a failure outside
    :mod:`uc_checkpoint.errors`' hierarchy is a :class:`~uc_checkpoint.errors.RemoteRankError` on
    every rank. Not thread-safe: call it from the training loop, on every rank, in the same order
    (each call that agrees across ranks is a collective on the manager's own foreground group).

    A peer that stops answering (hung, SIGSTOPped, its node frozen or partitioned) fails every
    call that waits for it within about ``timeout``: the calls that agree across ranks
    (:meth:`preemption_requested`, :meth:`latest`, :meth:`list`, :meth:`load`, :meth:`save`,
    :meth:`should_save` with a measured policy) raise
    :class:`~uc_checkpoint.errors.PeerTimeoutError`, and so does :meth:`wait` for a save whose
    background collectives timed out (that save publishes nothing; its thread ends, so the process
    can exit). After a collective timed out, every later collective of the manager raises it at
    once (gloo has closed the groups' connections): the job should exit and be restarted.
    """

    def __init__(
        self,
        root: str | Volume,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        staging: Staging | None = None,
        process_group: dist.ProcessGroup | None = None,
        staging_dir: str | None = None,
        list_attempts: int = 5,
        list_backoff_s: float = 1.0,
        write_pointer: bool = True,
        writer: WriterOptions | None = None,
        reader: ReaderOptions | None = None,
        volume_options: dict[str, Any] | None = None,
        save_interval: IntervalPolicy | None = None,
        timeout: float | timedelta | None = None,
    ) -> None:
        check_manager_arguments(
            root,
            keep_last=keep_last,
            keep_every=keep_every,
            list_attempts=list_attempts,
            staging=staging,
            writer=writer,
            reader=reader,
        )
        checked_timeout = check_timeout(timeout)
        #: Settings of each save's writer and each load's reader. To change them between saves,
        #: assign new ones: ``manager.writer_options = dataclasses.replace(manager.writer_options,
        #: upload_workers=2)``.
        self.writer_options: WriterOptions = writer or WriterOptions()
        self.reader_options: ReaderOptions = reader or ReaderOptions()
        #: How each save runs (:class:`~uc_checkpoint.dcp.options.Staging`).
        self.staging: Staging = staging or Staging()
        self.root = open_volume(root, **(volume_options or {}))
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._staging_buffers = StagingBuffers() if self.staging.reuse_buffers else None
        self.process_group = process_group
        self.staging_dir = staging_dir
        self.write_pointer = write_pointer
        self._pending: inflight.PendingSave | None = None
        # The background copy of the save in flight, while it may still be reading the state.
        self._copying: Future | None = None
        #: The :class:`~uc_checkpoint.observability.SaveEvent` of the last save (None before the first).
        self.last_save: SaveEvent | None = None
        self._preemption = PreemptionNotice()
        self._ranks = RankGroup(process_group, checked_timeout, name=self.root.url)
        # The root's checkpoints as rank 0 sees them, the steps known to be abandoned among them.
        self._view = RootView(self.root, attempts=list_attempts, backoff_s=list_backoff_s)
        # Lineage (see uc_checkpoint.ops.lineage): the step this manager loaded, and whether its
        # first save checked for a rollback.
        self._resumed_from: int | None = None
        self._lineage_checked = False
        self._schedule = None if save_interval is None else SaveSchedule(save_interval, self._ranks)
        #: The MLflow run id the checkpoint last loaded recorded (None: none, or nothing loaded).
        self.resumed_mlflow_run_id: str | None = None

    # ------------------------------------------------------------------ ranks

    def _on_leader(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 of the group; every rank gets its result or the same error."""
        return self._ranks.on_leader(f"{what} under {self.root.url}", fn)

    # ------------------------------------------------------------------ listing

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every step location under the root, oldest first (published or not), as the root shows
        it now: a save of this manager still in flight is missing or listed as unpublished until it
        is published (call :meth:`wait` first to list it; :meth:`load` waits for it itself).

        Requests: one recursive listing of the root, whose keys say which locations hold a
        ``.metadata`` (:func:`uc_checkpoint.ops.catalog.list_steps`): on S3 one request per 1,000
        keys under the root, nothing per checkpoint. Nothing is read: whether a checkpoint is also
        intact is what :meth:`latest` checks.

        Raises:
            VolumeError: the root cannot be listed (after ``list_attempts`` attempts) or is unusable.
        """
        return self._on_leader("list checkpoints", self._view.list_all)

    def latest(self) -> int | None:
        """Step of the newest checkpoint that is published and intact (``.metadata`` loads, every
        data file it references exists with its recorded size), or None when there is none. Broken
        newer ones are skipped with a warning; ones a rollback abandoned (see :meth:`save`) are
        skipped too. Rank 0 decides; every rank gets the same answer.

        Published checkpoints only: a save of this manager still in flight does not count until it
        is published, so right after an async :meth:`save` this may still name the previous step
        (or None). Call :meth:`wait` first to include it; :meth:`load` waits for it itself.

        Requests: a listing of the root itself (one per 1,000 locations), then, newest first until
        one is intact, a GET of each one's ``.metadata`` and a listing of its location: three in
        the usual case, however many checkpoints the root keeps.

        Raises:
            VolumeError: the root, a checkpoint's location or its ``.metadata`` cannot be read after
                ``list_attempts`` attempts, or the store is unusable (a store error is never taken
                for "no checkpoint" or "broken": that would silently resume from an older step).
        """
        return self._on_leader(
            "find the latest checkpoint", lambda: self._view.latest_step(self.reader_options.allow_unsafe_metadata)
        )

    # ------------------------------------------------------------------ save

    def save(self, step: int, state_dict: dict[str, Any]) -> Future:
        """Save ``state_dict`` as the checkpoint of ``step`` (every rank calls it).

        Waits for the previous save first (one save in flight) and raises its error, if any. With
        an asynchronous ``staging`` mode the returned future completes when the checkpoint is published (``.metadata``
        written); otherwise the save is done when this returns.

        When it returns, the state may change: the save works on its own copy; except with
        ``Staging(background_copy=True)``, where the copy is still being taken: call :meth:`wait_until_staged`
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
        started = time.monotonic()
        done = self._save(step, state_dict, asynchronous=self.staging.asynchronous)
        if self._schedule is not None:
            self._schedule.saved(step, time.monotonic() - started)
        return done

    def should_save(self, step: int) -> bool:
        """Whether to :meth:`save` at ``step`` by the ``save_interval`` policy: every rank calls it
        at every step and gets the same answer, without collectives
        (:class:`~uc_checkpoint.ops.schedule.SaveSchedule`). Stays True until :meth:`save`.

        Raises:
            ValueError: the manager has no ``save_interval``, or ``step`` is negative.
            TypeError: ``step`` is not an int.
        """
        if self._schedule is None:
            raise ValueError("should_save() needs CheckpointManager(save_interval=...), e.g. EverySteps(1000)")
        return self._schedule.should_save(step)

    def wait_until_staged(self, timeout: float | None = None) -> None:
        """Block until the save in flight no longer reads the state passed to :meth:`save`; from
        then on the training loop may change it in place. Returns at once when no staging is in
        progress (no save in flight, a synchronous save, no ``background_copy``, or already
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
        copying, self._copying = self._copying, None
        if copying is None:
            return
        try:
            futures_wait([copying], timeout=timeout)
        finally:
            if not copying.done():
                self._copying = copying
        if not copying.done():
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
        leader = self._ranks.is_leader()
        run_id = current_mlflow_run_id() if leader else None
        writer = UCVolumeWriter(
            location,
            options=self.writer_options,
            staging_dir=self.staging_dir,
            staging_buffers=self._staging_buffers,
            mlflow_run_id=run_id,
        )
        if asynchronous and self.staging.mode == "process" and self._ranks.distributed():
            writer.process_group_timeout = self._ranks.timeout()  # DCP's checkpoint process's own group
        group = self._ranks.save_group()
        pending = inflight.PendingSave(step, location.url, leader, run_id, asynchronous)  # starts the clock
        try:
            fut, staging = self._ranks.collective(
                f"save step {step} to {location.url}",
                partial(
                    inflight.start_dcp_save,
                    state_dict,
                    writer,
                    group,
                    asynchronous=asynchronous,
                    staging=self.staging,
                ),
            )
        except BaseException as exc:
            self._record(SaveEvent(step, location.url, pending.elapsed_s(), error=one_line(exc)), pending)
            raise
        pending.blocked_s = pending.elapsed_s()
        self._pending = pending
        if staging is not None:
            self._copying = staging
            staging.add_done_callback(partial(inflight.staged, pending))
        fut.add_done_callback(partial(self._on_saved, pending))
        return pending.done

    def _on_saved(self, pending: inflight.PendingSave, fut: Future) -> None:
        """DCP's future ``fut`` completed: record the save, run rank 0's housekeeping, then complete
        the caller's future (so that :meth:`wait` covers the housekeeping too). A peer's timeout
        in the save's collectives completes it with a :class:`PeerTimeoutError` instead."""
        error = None if fut.cancelled() else fut.exception()
        peer = (
            None
            if error is None
            else self._ranks.peer_timeout(f"save step {pending.step} to {pending.location}", error, pending.elapsed_s())
        )
        if peer is not None:
            fut = Future()
            fut.set_exception(peer)
        try:
            self._record(inflight.save_event(pending, fut), pending)
        except Exception:  # noqa: BLE001 - a record must never leave wait() blocked
            logger.exception("checkpoint manager: recording the save of step %d failed", pending.step)
        if pending.leader:
            self._after_publish(pending.step, fut)  # logs its own failures
        inflight.relay(fut, pending.done)

    def _record(self, event: SaveEvent, pending: inflight.PendingSave) -> None:
        self.last_save = event
        inflight.record(event, pending)

    def _check_rollback(self, step: int) -> builtins.list[int]:
        """Rank 0, before this manager's first save: the steps a rollback to the step it loaded
        abandons now (:meth:`uc_checkpoint.ops.root_view.RootView.mark_rollback`)."""
        return self._view.mark_rollback(step, self._resumed_from, self.reader_options.allow_unsafe_metadata)

    def wait(self) -> None:
        """Wait for the save in flight, if any (its staging, upload, publish and housekeeping);
        raise its error. A save's error is raised once: the next call returns at once.
        :meth:`save`, :meth:`load` and :meth:`save_final` call this (or, for the last, its bounded
        form) themselves first.

        Raises:
            CheckpointException (DCP's, a ``BaseException``) with our errors inside: the save failed.
            PeerTimeoutError: a peer did not take part in the save's collectives within ``timeout``.
        """
        self.wait_until_staged()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.done.result()

    def _after_publish(self, step: int, fut: Future) -> None:
        """Housekeeping on rank 0 after ``step`` was published: the ``latest`` pointer, then
        retention. Each runs whatever happened to the other (a mount that refuses to replace the
        pointer must not stop old checkpoints from being deleted, nor the reverse); a failure is
        logged with the step and location, never raised into training."""
        if fut.cancelled() or fut.exception() is not None:
            return  # nothing published: keep everything
        # One listing serves both; without it neither can run safely (the pointer could move back to
        # an older step, retention could not tell what exists).
        infos = self._housekeeping(step, "listing the checkpoints", self._view.list_steps)
        if infos is None:
            return
        # The pointer names the newest checkpoint of the run's line: saving an older step again must
        # not move it back (abandoned steps do not count). Only steps above this one can say so,
        # usually none: the housekeeping's requests do not grow with the checkpoints kept.
        newer = [i for i in infos if i.step > step and i.step not in self._view.abandoned]
        if self.write_pointer and not any(self._view.published(i) for i in newer):
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
        """Write the root's ``latest`` pointer to ``step`` (:func:`uc_checkpoint.ops.catalog.write_pointer`)."""
        catalog.write_pointer(self.root, step)

    def read_latest_pointer(self) -> dict[str, Any] | None:
        """The ``latest`` pointer's content (:func:`uc_checkpoint.ops.catalog.read_pointer`)."""
        return catalog.read_pointer(self.root)

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
        return self._prune(self._view.list_steps(), protect)

    def _prune(self, infos: builtins.list[CheckpointInfo], protect: set[int] | frozenset[int]) -> builtins.list[int]:
        """Retention over ``infos`` (:meth:`uc_checkpoint.ops.root_view.RootView.prune`), the save
        in flight protected too."""
        if self.keep_last is None:
            return []
        keep = set(protect) | ({self._pending.step} if self._pending is not None else set())
        return self._view.prune(
            infos,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            protect=keep,
            newest_saved=max(protect, default=None),
            allow_unsafe=self.reader_options.allow_unsafe_metadata,
        )

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
        same answer, so that they stop and save together.

        Raises:
            PeerTimeoutError: a peer did not take part within ``timeout`` (see the class docstring).
        """
        return self._ranks.any_rank(f"agree on preemption under {self.root.url}", self._preemption.received)

    def save_final(self, step: int, state_dict: dict[str, Any], budget_s: float = 60.0) -> bool:
        """The last checkpoint before a preemption: wait for the save in flight, then save ``step``
        synchronously (every rank calls it). Returns True when it was published.

        ``budget_s`` (seconds) bounds the wait for the save in flight: if that save has not finished
        by then, no new save is started (it could not finish either) and False is returned; the
        save in flight may still land. A final save that itself runs past the budget is logged;
        DCP cannot abandon a save midway, and stopping one would only leave an unpublished location.

        A save in flight that failed is logged and superseded by the final save (on every rank:
        DCP gives each the same outcome).

        Raises:
            CheckpointException (DCP's): the final save failed.
            PeerTimeoutError: a peer did not take part in the save in flight or the final save
                within ``timeout`` (no save can be agreed on then).
        """
        deadline = time.monotonic() + budget_s
        self.wait_until_staged()  # a copy is a few seconds at most; the state is needed right after
        pending, self._pending = self._pending, None
        landed = False
        if pending is not None:
            # Told apart by futures_wait, not by the exception result() raises: DCP's
            # CheckpointException is a BaseException, and PeerTimeoutError is a TimeoutError,
            # which is what result() raises when the wait runs out.
            done, _ = futures_wait([pending.done], timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                self._pending = pending
                logger.error(
                    "checkpoint manager: the save of step %d did not finish within %.0f s; no final save",
                    pending.step,
                    budget_s,
                )
                return False
            failure = pending.done.exception()
            if isinstance(failure, PeerTimeoutError):
                raise failure  # the ranks lost contact: no save can agree now
            if failure is None:
                landed = True
            else:  # the final save below supersedes it
                logger.warning(
                    "checkpoint manager: the save of step %d failed (%s); taking the final save",
                    pending.step,
                    one_line(failure),
                )
        if landed and pending is not None and pending.step == step:
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
        if explicit and not self._on_leader(f"look up step {step}", lambda: self._view.metadata_exists(location)):
            raise CheckpointNotFoundError(
                f"no published checkpoint at step {step}: {location.url_of(METADATA_NAME)} does not exist"
            )
        reader = UCVolumeReader(location, options=self.reader_options, staging_dir=self.staging_dir)
        self._ranks.collective(
            f"load step {step} from {location.url}",
            lambda: dcp.load(state_dict, storage_reader=reader, process_group=self._ranks.agree_group()),
        )
        self._resumed_from = step
        self.resumed_mlflow_run_id = recorded_mlflow_run_id(reader.last_manifest)
        if self._schedule is not None:
            self._schedule.restart()
        return step


__all__ = ["CheckpointManager"]
