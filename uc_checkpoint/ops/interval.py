"""How often to save: interval policies and the schedule behind ``CheckpointManager.should_save``.

A policy says, at a decision step, which step the next save should be at. The decisions are pure
functions of step numbers and measured seconds (:func:`steps_covering`, :func:`next_save_step`,
:func:`blocked_fraction_interval_s`, :func:`young_interval_s`, :func:`daly_interval_s`), wrapped by
small policy classes:

- :class:`EverySteps` ``(n)``: steps ``n, 2n, 3n, ...``; the same on every rank without measuring.
- :class:`EverySeconds` ``(every_s)``: about every ``every_s`` seconds of training.
- :class:`BlockedFraction` ``(max_fraction)``: keep the time training is blocked by saves under a
  fraction of the wall time (CheckFreq, Mohan et al., FAST '21, which sizes the interval from the
  measured cost of a checkpoint).
- :class:`YoungDaly` ``(mtbf_s)``: the interval that minimises the expected time lost to saves and
  to work redone after failures: ``sqrt(2 * C * MTBF)`` (Young, CACM 17(9), 1974), or Daly's
  higher-order estimate (Daly, FGCS 22(3), 2006).
- :class:`Tighter` / :class:`Looser` ``(*policies)``: the sooner / later of several.

Units: seconds for every time, training steps for every step. "Step time" is the mean seconds of
one training step with the time spent in ``save()`` taken out; "save cost" is the seconds the last
``save()`` call blocked the training loop (for async saves: the wait for the previous save, if any,
and the copy of the state).

:class:`SaveSchedule` is what the manager holds. Every rank calls :meth:`SaveSchedule.should_save`
at every step and gets the same answer without a collective on any process group (an async save's
collectives run in a background thread; a collective from the training thread could pair with
them). A deterministic policy is computed on every rank alike. A measured one depends on clocks
that differ between ranks, so rank 0 of the group decides, and hands its decision to the other
ranks through the c10d store (``set``/``get``, not collectives): decision ``n`` under the key
``uc_checkpoint/next_save/<root>/<leader rank>/<schedule>/<n>``. Decisions are taken at the first
``should_save`` call, at the first call after each save, and at a re-decision step (the first
decision of a measured policy cannot know the step time yet: it times :data:`PROBE_STEPS` steps
first). The other ranks read a decision at the same step rank 0 takes it, so they may wait there
for rank 0 (never in a collective), at most the manager's timeout: a rank 0 that does not decide
by then (hung, stopped) is a :class:`~uc_checkpoint.errors.PeerTimeoutError` naming it. Docs:
docs/operating.md, "How often to save".
"""

from __future__ import annotations

import json
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from uc_checkpoint.dcp import compat
from uc_checkpoint.ops.ranks import hung_peer, timed_out

logger = logging.getLogger(__name__)

#: Steps rank 0 times before the first decision of a policy that needs the step time.
PROBE_STEPS = 5


def check_seconds(name: str, value: float) -> float:
    """``value`` as a float when it is a finite number of seconds > 0.

    Raises:
        TypeError: ``value`` is not a number (a bool is not).
        ValueError: it is zero, negative, NaN or infinite; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_fraction(name: str, value: float) -> float:
    """``value`` as a float when it is strictly between 0 and 1.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: it is not in (0, 1) or is NaN; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0 < value < 1:  # also False for NaN
        raise ValueError(f"{name} must be > 0 and < 1, got {value!r}")
    return float(value)


def steps_covering(interval_s: float, step_s: float) -> int:
    """The fewest whole steps of ``step_s`` seconds that last at least ``interval_s`` seconds, and
    at least 1 (a step longer than the interval: save at every step). ``interval_s`` may be 0
    (save at the next step).

    Raises:
        ValueError: ``interval_s`` is negative or not finite, or ``step_s`` is not > 0 (each named).
    """
    if not math.isfinite(interval_s) or interval_s < 0:
        raise ValueError(f"interval_s must be a finite number of seconds >= 0, got {interval_s!r}")
    step_s = check_seconds("step_s", step_s)
    # A relative tolerance so that 3600 s / 0.1 s is 36000 steps, not 36001 from rounding.
    return max(1, math.ceil(interval_s / step_s * (1 - 1e-12)))


def next_save_step(step: int, anchor: int, interval_s: float, step_s: float) -> int:
    """The step of the next save, decided at ``step``: ``interval_s`` seconds of training after
    ``anchor`` (the last step before the interval began: the last save, or the step before the
    first one seen), in whole steps of ``step_s`` seconds (:func:`steps_covering`), and never at or
    before ``step`` (a save overdue is taken at the next step).

    Raises:
        ValueError: as :func:`steps_covering`; ``anchor`` after ``step``.
    """
    if anchor > step:
        raise ValueError(f"anchor must be <= step, got anchor={anchor} and step={step}")
    return max(step + 1, anchor + steps_covering(interval_s, step_s))


def next_multiple(anchor: int, every_steps: int) -> int:
    """The smallest positive multiple of ``every_steps`` after ``anchor`` (steps ``n, 2n, ...``;
    never step 0).

    Raises:
        ValueError: ``every_steps`` is not >= 1.
    """
    if every_steps < 1:
        raise ValueError(f"every_steps must be >= 1, got {every_steps}")
    return (max(anchor, 0) // every_steps + 1) * every_steps


def blocked_fraction_interval_s(save_s: float, max_fraction: float) -> float:
    """Seconds of training between saves so that saves block training for at most
    ``max_fraction`` of the wall time: ``save_s / (save_s + interval) <= max_fraction``, so
    ``interval = save_s * (1 - max_fraction) / max_fraction`` (CheckFreq's bound on checkpoint
    overhead, Mohan et al., FAST '21).

    Args:
        save_s: seconds one save blocks the training loop (> 0).
        max_fraction: the largest share of wall time saves may take, in (0, 1).

    Raises:
        ValueError: ``save_s`` not > 0 or ``max_fraction`` not in (0, 1) (each named).
    """
    save_s = check_seconds("save_s", save_s)
    max_fraction = check_fraction("max_fraction", max_fraction)
    return save_s * (1 - max_fraction) / max_fraction


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum of the seconds of work between checkpoints,
    ``sqrt(2 * cost_s * mtbf_s)`` (J. W. Young, "A first order approximation to the optimum
    checkpoint interval", CACM 17(9), 1974).

    Args:
        cost_s: seconds one checkpoint costs the job (> 0).
        mtbf_s: mean seconds between failures of the job as a whole (> 0): for ``N`` nodes that
            fail independently, a node's MTBF over ``N``.

    Raises:
        ValueError: either is not > 0 (named).
    """
    return math.sqrt(2 * check_seconds("cost_s", cost_s) * check_seconds("mtbf_s", mtbf_s))


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of the seconds of work between checkpoints (J. T. Daly, "A
    higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006):
    with ``x = cost_s / (2 * mtbf_s)``, ``sqrt(2 * cost_s * mtbf_s) * (1 + sqrt(x) / 3 + x / 9) -
    cost_s`` while ``cost_s < 2 * mtbf_s``, else ``mtbf_s``. Close to :func:`young_interval_s`
    when a save is cheap next to the MTBF; shorter when it is not.

    Raises:
        ValueError: either is not > 0 (named).
    """
    cost_s, mtbf_s = check_seconds("cost_s", cost_s), check_seconds("mtbf_s", mtbf_s)
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


@dataclass(frozen=True)
class Measured:
    """What rank 0 has measured when it decides.

    Attributes:
        step_s: mean seconds of one training step, save time taken out (None: not measured yet).
        save_s: seconds the last ``save()`` blocked the training loop (None: no save yet).
    """

    step_s: float | None = None
    save_s: float | None = None


class IntervalPolicy(ABC):
    """How often to save: :meth:`next_save` decides the step of the next save."""

    #: Whether the decision depends on measurements (then rank 0 decides for every rank).
    measured: bool = True

    @abstractmethod
    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        """The step of the next save, decided at ``step`` (at or after it; after ``anchor``): the
        interval runs from ``anchor``, the last save or the step before the first one seen
        (``anchor <= step``). None: the step time is needed first (the schedule times
        :data:`PROBE_STEPS` steps and asks again)."""


class EverySteps(IntervalPolicy):
    """Save at steps ``every_steps, 2 * every_steps, ...`` (never step 0); the same on every rank
    without measurements or a store.

    Raises:
        TypeError: ``every_steps`` is not an int.
        ValueError: it is not >= 1.
    """

    measured = False

    def __init__(self, every_steps: int) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int):
            raise TypeError(f"every_steps must be an int, got {type(every_steps).__name__}")
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.every_steps = every_steps

    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        return next_multiple(max(anchor, step - 1), self.every_steps)

    def __repr__(self) -> str:
        return f"EverySteps({self.every_steps})"


class EverySeconds(IntervalPolicy):
    """Save about every ``every_s`` seconds of training (in whole steps of the measured step time,
    rounded up: :func:`next_save_step`).

    Raises:
        TypeError / ValueError: ``every_s`` is not a finite number of seconds > 0.
    """

    def __init__(self, every_s: float) -> None:
        self.every_s = check_seconds("every_s", every_s)

    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        if measured.step_s is None:
            return None
        return next_save_step(step, anchor, self.every_s, measured.step_s)

    def __repr__(self) -> str:
        return f"EverySeconds({self.every_s})"


class BlockedFraction(IntervalPolicy):
    """Save as often as keeps the time ``save()`` blocks training under ``max_fraction`` of the
    wall time (:func:`blocked_fraction_interval_s` of the last save's measured cost; CheckFreq,
    Mohan et al., FAST '21). Before the first save its cost is unknown: the first save is taken
    as soon as the step time is measured, to measure it.

    Raises:
        TypeError / ValueError: ``max_fraction`` is not a number in (0, 1).
    """

    def __init__(self, max_fraction: float) -> None:
        self.max_fraction = check_fraction("max_fraction", max_fraction)

    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        if measured.step_s is None:
            return None
        if measured.save_s is None:
            return step + 1
        interval = blocked_fraction_interval_s(max(measured.save_s, _TINY_S), self.max_fraction)
        return next_save_step(step, anchor, interval, measured.step_s)

    def __repr__(self) -> str:
        return f"BlockedFraction({self.max_fraction})"


class YoungDaly(IntervalPolicy):
    """Save at the interval that minimises the time lost to saves and to work redone after a
    failure, with the last save's measured cost as ``C``: Daly's higher-order estimate
    (:func:`daly_interval_s`) or, with ``higher_order=False``, Young's ``sqrt(2 * C * MTBF)``
    (:func:`young_interval_s`). Like :class:`BlockedFraction`, the first save is taken as soon as
    the step time is measured, to measure its cost.

    Args:
        mtbf_s: mean seconds between failures of the whole job (> 0).
        higher_order: Daly's estimate (True) or Young's (False).

    Raises:
        TypeError / ValueError: ``mtbf_s`` is not a finite number of seconds > 0.
    """

    def __init__(self, mtbf_s: float, *, higher_order: bool = True) -> None:
        self.mtbf_s = check_seconds("mtbf_s", mtbf_s)
        self.higher_order = higher_order

    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        if measured.step_s is None:
            return None
        if measured.save_s is None:
            return step + 1
        optimum = daly_interval_s if self.higher_order else young_interval_s
        return next_save_step(step, anchor, optimum(max(measured.save_s, _TINY_S), self.mtbf_s), measured.step_s)

    def __repr__(self) -> str:
        return f"YoungDaly({self.mtbf_s}, higher_order={self.higher_order})"


class _Combined(IntervalPolicy):
    def __init__(self, *policies: IntervalPolicy) -> None:
        if len(policies) < 2 or not all(isinstance(p, IntervalPolicy) for p in policies):
            raise TypeError(f"{type(self).__name__} takes two or more interval policies, got {policies!r}")
        self.policies = policies
        self.measured = any(p.measured for p in policies)

    def _steps(self, step: int, anchor: int, measured: Measured) -> list[int] | None:
        steps = [p.next_save(step, anchor, measured) for p in self.policies]
        return None if any(s is None for s in steps) else [s for s in steps if s is not None]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.policies))})"


class Tighter(_Combined):
    """The sooner next save of several policies, e.g. ``Tighter(YoungDaly(mtbf_s=...),
    EverySeconds(3600))``: the optimum, but at least hourly.

    Raises:
        TypeError: fewer than two policies, or something that is not one.
    """

    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        steps = self._steps(step, anchor, measured)
        return None if steps is None else min(steps)


class Looser(_Combined):
    """The later next save of several policies, e.g. ``Looser(BlockedFraction(0.05),
    EverySeconds(600))``: at most 5% blocked, and no more often than every 10 minutes.

    Raises:
        TypeError: fewer than two policies, or something that is not one.
    """

    def next_save(self, step: int, anchor: int, measured: Measured) -> int | None:
        steps = self._steps(step, anchor, measured)
        return None if steps is None else max(steps)


#: Save costs below this many seconds count as this (a zero would make the interval zero).
_TINY_S = 1e-6


@dataclass(frozen=True)
class Decision:
    """One decision of a :class:`SaveSchedule`: at ``step``, save (``action="save"``) or decide
    again (``"decide"``: the step time was not measured yet)."""

    step: int
    action: str

    def to_bytes(self) -> bytes:
        return json.dumps({"step": self.step, "action": self.action}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> Decision:
        """Raises: ValueError: ``raw`` is not a decision (``where`` names the key)."""
        try:
            body = json.loads(raw)
            decision = cls(int(body["step"]), str(body["action"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the save schedule's key {where} holds {raw!r}, not a decision") from exc
        if decision.action not in ("save", "decide"):
            raise ValueError(f"the save schedule's key {where} holds an unknown action {decision.action!r}")
        return decision


class SaveSchedule:
    """The state behind ``CheckpointManager.should_save`` on one rank (see the module docstring).

    Args:
        policy: the interval policy.
        name: what tells this schedule's store keys from others' (the manager passes its root URL).
        group: the ranks that decide together (None: every rank, or a single process).
        clock: seconds, monotonic (rank 0's step timing).
        timeout: the longest wait for rank 0's decision (read when a rank waits); None: the
            store's own timeout.

    Not thread-safe: the training loop calls it, on every rank, at the same steps.
    """

    def __init__(
        self,
        policy: IntervalPolicy,
        name: str,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
        timeout: Callable[[], timedelta] | None = None,
    ) -> None:
        if not isinstance(policy, IntervalPolicy):
            raise TypeError(f"save_interval must be an interval policy (EverySteps, ...), got {type(policy).__name__}")
        self.policy = policy
        self.name = name
        self.group = group
        self.clock = clock
        self.timeout = timeout
        self._target: Decision | None = None
        self._decisions = 0
        self._anchor: int | None = None
        self._prefix: str | None = None
        self._store: Any = None
        self._leader_rank: int | None = None  # rank 0 of the group, as a global rank
        # Rank 0's measurements: the window since its last decision (clock, step, save seconds).
        self._window: tuple[float, int, float] | None = None
        self._measured = Measured()

    # ---- ranks and store
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _leader(self) -> bool:
        return not self._distributed() or dist.get_rank(self.group) == 0

    def _key(self, n: int) -> str:
        if self._prefix is None:
            self._store = compat.default_store()
            leader = self._leader_rank = dist.get_process_group_ranks(self.group or dist.group.WORLD)[0]
            base = f"uc_checkpoint/next_save/{self.name}/{leader}"
            # Each rank counts its own schedules of this root: ranks create them in the same order,
            # so the n-th one on every rank shares keys with the n-th one on the others.
            serial = self._store.add(f"{base}/schedules/{dist.get_rank()}", 1)
            self._prefix = f"{base}/{serial}"
        return f"{self._prefix}/{n}"

    # ---- the training loop's calls
    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``; the same answer on every rank. Call it at every step (or
        at the same steps on every rank); it stays True until a save is made.

        Raises:
            TypeError: ``step`` is not an int.
            ValueError: ``step`` is negative, or a store key holds something else than a decision.
            PeerTimeoutError: rank 0 did not decide within the timeout (a rank other than 0).
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._anchor is None:
            self._anchor = step - 1
        if self._target is None:
            self._decide(step)
        while self._target is not None and self._target.action == "decide" and step >= self._target.step:
            self._decide(step)
        assert self._target is not None
        return self._target.action == "save" and step >= self._target.step

    def saved(self, step: int, blocked_s: float) -> None:
        """``save(step)`` was called on every rank and blocked ``blocked_s`` seconds here: the next
        interval runs from ``step``, decided at the next :meth:`should_save`."""
        self._anchor = step
        self._target = None
        self._measured = Measured(self._measured.step_s, max(blocked_s, 0.0))
        if self._window is not None:
            start, start_step, blocked = self._window
            self._window = (start, start_step, blocked + max(blocked_s, 0.0))

    def restart(self) -> None:
        """A load on every rank: the next :meth:`should_save` starts the interval afresh (rank 0
        keeps its measurements, but not the time spent loading)."""
        self._anchor = None
        self._target = None
        self._window = None

    # ---- decisions
    def _measure(self, step: int, now: float) -> Measured:
        """Rank 0: the step time over the window since its last decision (kept when the window
        holds no step), and a new window from ``step``."""
        measured = self._measured
        if self._window is not None:
            start, start_step, blocked = self._window
            if step > start_step:
                step_s = max((now - start - blocked) / (step - start_step), _TINY_S)
                measured = Measured(step_s, measured.save_s)
        self._window = (now, step, 0.0)
        self._measured = measured
        return measured

    def _decide(self, step: int) -> None:
        n = self._decisions
        self._decisions += 1
        assert self._anchor is not None
        if not self.policy.measured or self._leader():
            measured = self._measure(step, self.clock()) if self.policy.measured else Measured()
            target = self.policy.next_save(step, min(self._anchor, step), measured)
            decision = Decision(step + PROBE_STEPS, "decide") if target is None else Decision(target, "save")
            if self.policy.measured and self._distributed():
                key = self._key(n)  # opens the store first
                self._store.set(key, decision.to_bytes())
            logger.debug("save schedule %s: decision %d at step %d: %s (%s)", self.policy, n, step, decision, measured)
        else:
            key = self._key(n)
            decision = Decision.from_bytes(self._wait_for_leader(key, step), key)
        self._target = decision

    def _wait_for_leader(self, key: str, step: int) -> bytes:
        """The value rank 0 sets under ``key``, waited for at most :attr:`timeout` (a store
        ``wait``, then a ``get``).

        Raises:
            PeerTimeoutError: it was not set in time (rank 0 hung, stopped or unreachable).
        """
        timeout = self.timeout() if self.timeout is not None else self._store.timeout
        started = time.monotonic()
        try:
            self._store.wait([key], timeout)
            return bytes(self._store.get(key))
        except RuntimeError as exc:
            if not timed_out(exc):
                raise
            what = f"receive the decision whether to save at step {step} for {self.name} (should_save)"
            raise hung_peer(what, f"rank {self._leader_rank}", timeout, exc, time.monotonic() - started) from exc


__all__ = [
    "PROBE_STEPS",
    "BlockedFraction",
    "Decision",
    "EverySeconds",
    "EverySteps",
    "IntervalPolicy",
    "Looser",
    "Measured",
    "SaveSchedule",
    "Tighter",
    "YoungDaly",
    "blocked_fraction_interval_s",
    "check_fraction",
    "check_seconds",
    "daly_interval_s",
    "next_multiple",
    "next_save_step",
    "steps_covering",
    "young_interval_s",
]
