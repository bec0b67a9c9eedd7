"""Which checkpoints a retention policy deletes: a pure function over steps, no volume, no ranks.

:class:`~uc_checkpoint.ops.manager.CheckpointManager` lists the root, asks :func:`plan` (which
looks up whether a location is published only where that decides something, then applies
:func:`steps_to_delete`) and deletes what it names (``.metadata`` first, then the data files).
Keeping the decision apart from the deletion lets it be tested over tables of cases, as
torchsnapshot's ``manifest_ops`` are.

This is the policy :func:`uc_checkpoint.ops.lineage.retention_plan` implements over ``(step,
abandoned)`` pairs; that function stays where it is (its tests and docs name it) and the two are
checked against each other by ``tests/test_retention.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Protocol, TypeVar


class _Step(Protocol):
    @property
    def step(self) -> int: ...


_I = TypeVar("_I", bound=_Step)


def steps_to_delete(
    published: Iterable[int],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Collection[int] = (),
    abandoned: Collection[int] = (),
) -> list[int]:
    """The published steps a retention policy deletes, oldest first.

    Args:
        published: the steps of every published checkpoint under the root (any order; unpublished
            locations are garbage collection's business, never retention's).
        keep_last: how many of the newest to keep; None keeps everything. "Newest" follows the
            run's lineage: every step of the current line is newer than every ``abandoned`` step
            (a rollback's abandoned branch, :mod:`uc_checkpoint.ops.lineage`), and within each group
            the higher step is newer.
        keep_every: also keep every step that is a multiple of this (None or 0: no such rule).
        protect: steps never deleted (the save just published, the one in flight).
        abandoned: the published steps a rollback abandoned.

    Only checkpoints older than the oldest of the ``keep_last`` newest are ever deleted, so a
    protected or ``keep_every`` step does not push a newer one out.
    (The manager checks ``keep_last >= 1`` when it is constructed; 0 here keeps only ``protect``
    and ``keep_every`` steps.)
    """
    if keep_last is None:
        return []
    gone = set(abandoned)
    ranked = sorted(set(published), key=lambda step: (step not in gone, step))  # oldest first
    keep = set(protect)
    if keep_every:
        keep.update(step for step in ranked if step % keep_every == 0)
    return [step for step in ranked[: max(0, len(ranked) - keep_last)] if step not in keep]


def plan(
    infos: Iterable[_I],
    is_published: Callable[[_I], bool],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Collection[int] = (),
    abandoned: Collection[int] = (),
) -> list[_I]:
    """The locations of ``infos`` a retention policy deletes, in :func:`steps_to_delete`'s order.

    ``infos`` is a listing of the root (records with a ``step``, such as
    :class:`~uc_checkpoint.ops.catalog.CheckpointInfo`), each published or not; ``is_published``
    says which (a lookup each, perhaps). It is asked only where the answer decides something:
    newest first, in the policy's order, until ``keep_last`` published ones are found, then for each
    older location that ``protect`` or ``keep_every`` does not keep anyway. So what a save's
    retention costs grows with what it deletes, not with what is kept. The other arguments are
    :func:`steps_to_delete`'s.

    Raises:
        Whatever ``is_published`` raises (nothing is deleted here).
    """
    if keep_last is None:
        return []
    gone = set(abandoned)
    ranked = sorted(infos, key=lambda i: (i.step not in gone, i.step), reverse=True)  # newest first
    published: list[_I] = []
    for info in ranked:
        if len(published) < keep_last:
            if is_published(info):
                published.append(info)
        elif info.step in protect or (keep_every and info.step % keep_every == 0):
            published.append(info)  # kept whatever it is: no need to look
        elif is_published(info):
            published.append(info)
    by_step = {i.step: i for i in published}
    deleted = steps_to_delete(by_step, keep_last=keep_last, keep_every=keep_every, protect=protect, abandoned=gone)
    return [by_step[step] for step in deleted]


__all__ = ["plan", "steps_to_delete"]
