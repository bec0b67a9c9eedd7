"""The decisions of uc_checkpoint.ops.interval as tables of inputs and expected steps or seconds."""

from __future__ import annotations

import math

import pytest

from uc_checkpoint.ops.interval import (
    BlockedFraction,
    EverySeconds,
    EverySteps,
    Looser,
    Measured,
    Tighter,
    YoungDaly,
    blocked_fraction_interval_s,
    daly_interval_s,
    next_multiple,
    next_save_step,
    steps_covering,
    young_interval_s,
)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("interval_s", "step_s", "steps"),
    [
        (3600.0, 1.0, 3600),
        (3600.0, 0.1, 36000),  # no extra step from rounding
        (10.0, 3.0, 4),  # rounded up: at least the interval
        (1.0, 5.0, 1),  # a step longer than the interval: every step
        (0.0, 2.0, 1),  # save at the next step
        (7.5, 2.5, 3),
        (1e-9, 1e-3, 1),
    ],
)
def test_steps_covering(interval_s: float, step_s: float, steps: int) -> None:
    assert steps_covering(interval_s, step_s) == steps


@pytest.mark.parametrize(
    ("interval_s", "step_s", "named"),
    [(-1.0, 1.0, "interval_s"), (NAN, 1.0, "interval_s"), (INF, 1.0, "interval_s"), (1.0, 0.0, "step_s")]
    + [(1.0, -2.0, "step_s"), (1.0, NAN, "step_s"), (1.0, INF, "step_s")],
)
def test_steps_covering_refuses(interval_s: float, step_s: float, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        steps_covering(interval_s, step_s)


@pytest.mark.parametrize(
    ("step", "anchor", "interval_s", "step_s", "expected"),
    [
        (0, -1, 10.0, 1.0, 9),  # first save: 10 steps after the one before the first seen
        (100, 100, 60.0, 2.0, 130),  # decided right at the save
        (101, 100, 60.0, 2.0, 130),  # decided at the step after it
        (150, 100, 60.0, 2.0, 151),  # overdue: the next step
        (100, 100, 1.0, 30.0, 101),  # very slow steps: every step
        (100, 100, 0.0, 1.0, 101),
    ],
)
def test_next_save_step(step: int, anchor: int, interval_s: float, step_s: float, expected: int) -> None:
    assert next_save_step(step, anchor, interval_s, step_s) == expected


def test_next_save_step_refuses_an_anchor_after_the_step() -> None:
    with pytest.raises(ValueError, match="anchor"):
        next_save_step(5, 6, 1.0, 1.0)


@pytest.mark.parametrize(
    ("anchor", "every", "expected"),
    [(-1, 100, 100), (0, 100, 100), (99, 100, 100), (100, 100, 200), (101, 100, 200), (5, 1, 6)],
)
def test_next_multiple(anchor: int, every: int, expected: int) -> None:
    assert next_multiple(anchor, every) == expected


@pytest.mark.parametrize(
    ("save_s", "fraction", "expected_s"),
    [(1.0, 0.5, 1.0), (1.0, 0.1, 9.0), (2.0, 0.05, 38.0), (120.0, 0.01, 11880.0), (1e-3, 0.99, 1e-3 / 99)],
)
def test_blocked_fraction_interval(save_s: float, fraction: float, expected_s: float) -> None:
    interval = blocked_fraction_interval_s(save_s, fraction)
    assert interval == pytest.approx(expected_s)
    assert save_s / (save_s + interval) == pytest.approx(fraction)  # exactly the bound


@pytest.mark.parametrize(
    ("save_s", "fraction", "named"),
    [(0.0, 0.1, "save_s"), (-1.0, 0.1, "save_s"), (NAN, 0.1, "save_s"), (1.0, 0.0, "max_fraction")]
    + [(1.0, 1.0, "max_fraction"), (1.0, -0.5, "max_fraction"), (1.0, NAN, "max_fraction")],
)
def test_blocked_fraction_refuses(save_s: float, fraction: float, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        blocked_fraction_interval_s(save_s, fraction)


@pytest.mark.parametrize(
    ("cost_s", "mtbf_s", "young_s"),
    [(60.0, 86400.0, math.sqrt(2 * 60 * 86400)), (1.0, 3600.0, math.sqrt(7200)), (30.0, 15.0, 30.0)],
)
def test_young(cost_s: float, mtbf_s: float, young_s: float) -> None:
    assert young_interval_s(cost_s, mtbf_s) == pytest.approx(young_s)


@pytest.mark.parametrize(
    ("cost_s", "mtbf_s", "expected_s"),
    [
        # x = C / 2M; sqrt(2CM) * (1 + sqrt(x)/3 + x/9) - C
        (60.0, 86400.0, math.sqrt(2 * 60 * 86400) * (1 + math.sqrt(60 / 172800) / 3 + 60 / 172800 / 9) - 60),
        (1.0, 0.5, 0.5),  # C >= 2M: the MTBF itself
        (100.0, 10.0, 10.0),
    ],
)
def test_daly(cost_s: float, mtbf_s: float, expected_s: float) -> None:
    assert daly_interval_s(cost_s, mtbf_s) == pytest.approx(expected_s)


def test_daly_is_close_to_young_for_cheap_saves_and_shorter_for_costly_ones() -> None:
    assert daly_interval_s(1.0, 1e6) == pytest.approx(young_interval_s(1.0, 1e6), rel=1e-3)
    assert daly_interval_s(600.0, 3600.0) < young_interval_s(600.0, 3600.0)


@pytest.mark.parametrize("fn", [young_interval_s, daly_interval_s])
@pytest.mark.parametrize(
    ("cost_s", "mtbf_s", "named"),
    [(0.0, 1.0, "cost_s"), (-1.0, 1.0, "cost_s"), (NAN, 1.0, "cost_s"), (1.0, 0.0, "mtbf_s"), (1.0, INF, "mtbf_s")],
)
def test_young_daly_refuse(fn, cost_s: float, mtbf_s: float, named: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=named):
        fn(cost_s, mtbf_s)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: EverySteps(0), "every_steps"),
        (lambda: EverySeconds(0), "every_s"),
        (lambda: EverySeconds(-3.0), "every_s"),
        (lambda: EverySeconds(NAN), "every_s"),
        (lambda: BlockedFraction(0.0), "max_fraction"),
        (lambda: BlockedFraction(NAN), "max_fraction"),
        (lambda: YoungDaly(mtbf_s=0.0), "mtbf_s"),
        (lambda: YoungDaly(mtbf_s=NAN), "mtbf_s"),
    ],
)
def test_policies_refuse_bad_arguments(make, named: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=named):
        make()


def test_policies_refuse_wrong_types() -> None:
    with pytest.raises(TypeError, match="every_steps"):
        EverySteps(2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every_s"):
        EverySeconds("60")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="two or more"):
        Tighter(EverySteps(3))


NONE = Measured()
TIMED = Measured(step_s=2.0)
COSTED = Measured(step_s=2.0, save_s=10.0)


@pytest.mark.parametrize(
    ("policy", "step", "anchor", "measured", "expected"),
    [
        (EverySteps(100), 0, -1, NONE, 100),  # never step 0
        (EverySteps(100), 100, 99, NONE, 100),  # the first step seen is a multiple
        (EverySteps(100), 101, 100, NONE, 200),
        (EverySteps(100), 250, 100, NONE, 300),  # called at sparse steps: the next multiple
        (EverySeconds(60), 0, -1, NONE, None),  # step time not measured yet
        (EverySeconds(60), 5, -1, TIMED, 29),
        (EverySeconds(60), 101, 100, TIMED, 130),
        (EverySeconds(1), 101, 100, Measured(step_s=90.0), 102),  # step longer than the interval
        (BlockedFraction(0.1), 5, -1, NONE, None),
        (BlockedFraction(0.1), 5, -1, TIMED, 6),  # first save: measure its cost
        (BlockedFraction(0.1), 11, 10, COSTED, 10 + 45),  # 90 s of training / 2 s per step
        (BlockedFraction(0.1), 11, 10, Measured(step_s=2.0, save_s=1000.0), 10 + 4500),  # very slow save
        (BlockedFraction(0.5), 11, 10, Measured(step_s=2.0, save_s=0.0), 12),  # free save: next step
        (YoungDaly(mtbf_s=3600.0), 5, -1, TIMED, 6),
        (YoungDaly(mtbf_s=3600.0, higher_order=False), 11, 10, COSTED, 10 + math.ceil(math.sqrt(72000) / 2)),
        (YoungDaly(mtbf_s=3600.0), 11, 10, COSTED, 10 + math.ceil(daly_interval_s(10.0, 3600.0) / 2)),
        (YoungDaly(mtbf_s=5.0), 11, 10, COSTED, 10 + 3),  # save cost above 2 * MTBF: every MTBF
        (Tighter(EverySteps(20), EverySeconds(60)), 11, 10, TIMED, 20),
        (Looser(EverySteps(20), EverySeconds(60)), 11, 10, TIMED, 40),
        (Tighter(EverySteps(20), EverySeconds(60)), 0, -1, NONE, None),  # one part cannot tell yet
        (Looser(BlockedFraction(0.1), EverySeconds(600)), 11, 10, COSTED, 310),
    ],
)
def test_policy_decisions(policy, step: int, anchor: int, measured: Measured, expected: int | None) -> None:  # type: ignore[no-untyped-def]
    assert policy.next_save(step, anchor, measured) == expected
