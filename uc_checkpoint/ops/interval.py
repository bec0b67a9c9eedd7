"""How often to save: interval policies, pure functions of step numbers and measured seconds.

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

The manager's :class:`~uc_checkpoint.ops.schedule.SaveSchedule` asks a policy at each decision and
hands rank 0's decision to every rank. Docs: docs/operating.md, "How often to save".
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

#: Save costs below this many seconds count as this (a zero would make the interval zero).
TINY_S = 1e-6


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
        :data:`~uc_checkpoint.ops.schedule.PROBE_STEPS` steps and asks again)."""


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
        interval = blocked_fraction_interval_s(max(measured.save_s, TINY_S), self.max_fraction)
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
        return next_save_step(step, anchor, optimum(max(measured.save_s, TINY_S), self.mtbf_s), measured.step_s)

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


__all__ = [
    "BlockedFraction",
    "EverySeconds",
    "EverySteps",
    "IntervalPolicy",
    "Looser",
    "Measured",
    "TINY_S",
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
