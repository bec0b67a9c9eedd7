"""What a :class:`~uc_checkpoint.ops.manager.CheckpointManager` knows of the checkpoints under its
root (:class:`RootView`): the root's listing, retried while the store fails to answer; whether a step
location is published; whether a published checkpoint is intact; and which steps a rollback
abandoned (:mod:`uc_checkpoint.ops.lineage`). Rank 0's view: the manager hands its answers to the
other ranks (:mod:`uc_checkpoint.ops.ranks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from uc_checkpoint.dcp import metadata_io
from uc_checkpoint.errors import TransferError, VolumeError
from uc_checkpoint.format.layout import METADATA_NAME
from uc_checkpoint.ops import catalog, lineage, retention
from uc_checkpoint.ops.catalog import CheckpointInfo
from uc_checkpoint.volumes import Volume
from uc_checkpoint.volumes.retry import retry

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RootView:
    """The step locations under ``root``, as one manager sees them.

    Args:
        root: the manager's root volume.
        attempts: attempts at each request that fails with :class:`TransferError` (throttling,
            network errors the store's client already retried) before :class:`VolumeError` is
            raised; the delay doubles from ``backoff_s`` seconds, at most 10 s. A store that fails
            to answer proves nothing about a checkpoint, so it is never taken for "no checkpoint"
            or "broken".
        backoff_s: the first retry delay, seconds.

    Attributes:
        abandoned: steps known to be abandoned by a rollback, recorded whenever a checkpoint's
            marker was looked at (:meth:`inspect`, :func:`uc_checkpoint.ops.lineage.mark_rollback`).
    """

    def __init__(self, root: Volume, *, attempts: int, backoff_s: float) -> None:
        self.root = root
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.abandoned: set[int] = set()

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried on :class:`TransferError` (:func:`uc_checkpoint.volumes.retry.retry`).

        Raises:
            VolumeError: still failing after ``attempts`` attempts (the TransferError is its cause);
                other errors of ``fn`` are raised at once (a missing bucket, a root that is a file).
        """
        what = f"{what} under {self.root.url}"

        def warn(attempt: int, delay: float, exc: BaseException) -> None:
            logger.warning(
                "checkpoint manager: %s failed (attempt %d of %d), retrying in %.1f s: %s",
                what,
                attempt,
                self.attempts,
                delay,
                exc,
            )

        try:
            return retry(
                fn,
                attempts=self.attempts,
                retry_on=TransferError,
                backoff_s=self.backoff_s,
                max_backoff_s=10.0,
                on_retry=warn,
            )
        except TransferError as exc:
            raise VolumeError(f"cannot {what} after {self.attempts} attempts: {exc}") from exc

    def list_all(self) -> list[CheckpointInfo]:
        """Every step location, oldest first, with whether it is published: one recursive listing
        (:func:`uc_checkpoint.ops.catalog.list_steps`)."""
        return self.retry("list checkpoints", lambda: catalog.list_steps(self.root))

    def list_steps(self) -> list[CheckpointInfo]:
        """The root's one listing, ``published`` not looked up yet (see :meth:`published`)."""
        return self.retry("list checkpoints", lambda: catalog.list_steps(self.root, published=False))

    def published(self, info: CheckpointInfo) -> bool:
        """Whether ``info``'s ``.metadata`` exists (one lookup when the listing did not say)."""
        return bool(catalog.is_published(self.root, info, self.retry).published)

    def inspect(self, info: CheckpointInfo, allow_unsafe: bool) -> CheckpointInfo:
        """``info`` inspected by the catalog (:func:`uc_checkpoint.ops.catalog.inspect_step`): its
        ``.metadata`` loads (unpickled without restrictions with ``allow_unsafe``), every data file
        it references is there with its recorded size, and no rollback abandoned it. Records the
        step in :attr:`abandoned`, or takes it out, whenever its marker was looked at.

        Only evidence of damage makes a problem: a missing or short file, a ``.metadata`` that is
        undecodable or unsafe, or one that vanished since the listing (no longer published).

        Raises:
            VolumeError: the ``.metadata`` cannot be read or the location cannot be listed after
                ``attempts`` attempts, or the store is unusable.
        """
        checked = catalog.inspect_step(
            self.root, info, retry=self.retry, allow_unsafe=allow_unsafe, rollback_first=True
        )
        if checked.abandoned:
            self.abandoned.add(info.step)
        elif checked.abandoned is not None:
            self.abandoned.discard(info.step)  # taken back, or saved again since
        return checked

    def latest_step(self, allow_unsafe: bool) -> int | None:
        """The newest published and intact step (:meth:`inspect`), or None; broken newer ones are
        skipped with a warning, abandoned ones with an info line.

        Raises:
            VolumeError: as :meth:`inspect`, or the root cannot be listed.
        """

        def skipped(info: CheckpointInfo) -> None:
            log = logger.info if info.step in self.abandoned else logger.warning
            log("checkpoint manager: skipping checkpoint %s: %s", self.root.url_of(info.name), info.problem)

        found = catalog.latest(
            self.root,
            infos=self.list_steps(),
            check=lambda info: self.inspect(info, allow_unsafe),
            on_skip=skipped,
        )
        return None if found is None else found.step

    def metadata_exists(self, location: Volume) -> bool:
        """Whether ``location`` has a ``.metadata``: one size lookup, and when that finds nothing,
        one listing of ``location`` (each retried as :meth:`retry`).

        Raises:
            VolumeError: either request still fails, or the store is unusable (a missing bucket).
        """
        what = f"look up {location.url_of(METADATA_NAME)}"
        if self.retry(what, lambda: location.size(METADATA_NAME)) is not None:
            return True
        # S3 answers a HEAD of a key in a missing bucket with a bare 404, as for a missing key (a
        # HEAD answer has no body to name the error); a listing tells the two apart.
        return METADATA_NAME in self.retry(what, location.list_files)

    def mark_rollback(self, step: int, resumed_from: int | None, allow_unsafe: bool) -> list[int]:
        """Before a manager's first save of ``step``, having loaded ``resumed_from`` (None: nothing):
        :func:`uc_checkpoint.ops.lineage.mark_rollback` over the root's listing, the manifests read
        as :meth:`inspect` reads them; returns the steps abandoned now (also in :attr:`abandoned`).
        """

        def read_manifest(location: Volume) -> Any:
            metadata = self.retry(
                f"read {location.url}", partial(metadata_io.read_metadata, location, allow_unsafe=allow_unsafe)
            )
            return metadata_io.manifest_of(metadata)

        return lineage.mark_rollback(
            self.root,
            step,
            resumed_from,
            infos=self.list_steps(),
            is_published=self.published,
            read_manifest=read_manifest,
            abandoned=self.abandoned,
            log=logger,
        )

    def prune(
        self,
        infos: list[CheckpointInfo],
        *,
        keep_last: int,
        keep_every: int | None,
        protect: set[int],
        newest_saved: int | None,
        allow_unsafe: bool,
    ) -> list[int]:
        """Retention over ``infos`` (a listing, ``published`` looked up or not): the plan
        (:func:`uc_checkpoint.ops.retention.plan`, which looks up whether a location is published
        only where that decides something), then the deletes, each checkpoint unpublished first
        (:func:`uc_checkpoint.ops.catalog.delete_checkpoint`). Returns the deleted steps.

        Args:
            infos: the root's listing.
            keep_last: published checkpoints kept, newest first.
            keep_every: steps that are multiples of it are kept (None: none).
            protect: steps never deleted.
            newest_saved: the step just saved (None: none): published steps above it are
                inspected first, since only they can belong to a branch another run's rollback
                abandoned that this view has not seen (usually none, so no request).
            allow_unsafe: as :meth:`inspect`.
        """
        for info in infos:
            if (
                newest_saved is not None
                and info.step > newest_saved
                and info.step not in self.abandoned
                and self.published(info)
            ):
                self.inspect(info, allow_unsafe)  # records the step as abandoned when its marker applies
        doomed = retention.plan(
            infos,
            self.published,
            keep_last=keep_last,
            keep_every=keep_every,
            protect=protect,
            abandoned=self.abandoned,
        )
        for info in doomed:
            catalog.delete_checkpoint(self.root.child(info.name))
        deleted = [info.step for info in doomed]
        if deleted:
            logger.info(
                "checkpoint manager: deleted checkpoints %s under %s (keep_last=%s, keep_every=%s)",
                deleted,
                self.root.url,
                keep_last,
                keep_every,
            )
        return deleted


__all__ = ["RootView"]
