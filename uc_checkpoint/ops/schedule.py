"""The schedule behind ``CheckpointManager.should_save``: when each rank asks its interval policy
(:mod:`uc_checkpoint.ops.interval`), and how every rank gets the same answer.

:class:`SaveSchedule` is what the manager holds. Every rank calls :meth:`SaveSchedule.should_save`
at every step and gets the same answer without a collective on any process group (an async save's
collectives run in a background thread; a collective from the training thread could pair with
them). A deterministic policy is computed on every rank alike. A measured one depends on clocks
that differ between ranks, so rank 0 of the group decides, and hands its decision to the other
ranks through the c10d store with the manager's :meth:`~uc_checkpoint.ops.ranks.RankGroup.decided`
(decision ``n`` under the key ``next_save/<n>`` of the manager's group, removed from the store once
every rank has read it). Decisions are taken at the first ``should_save`` call, at the first call
after each save, and at a re-decision step (the first decision of a measured policy cannot know the
step time yet: it times :data:`PROBE_STEPS` steps first). The other ranks read a decision at the
same step rank 0 takes it, so they may wait there for rank 0 (never in a collective), at most the
manager's timeout: a rank 0 that does not decide by then (hung, stopped) is a
:class:`~uc_checkpoint.errors.PeerTimeoutError` naming it. Docs: docs/operating.md, "How often to
save".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from uc_checkpoint.ops.interval import TINY_S, IntervalPolicy, Measured
from uc_checkpoint.ops.ranks import RankGroup

logger = logging.getLogger(__name__)

#: Steps rank 0 times before the first decision of a policy that needs the step time.
PROBE_STEPS = 5


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
        ranks: the ranks that decide together, and how (the manager's :class:`RankGroup`; its
            ``name`` is named in messages, its timeout bounds the wait for rank 0's decision).
        clock: seconds, monotonic (rank 0's step timing).

    Not thread-safe: the training loop calls it, on every rank, at the same steps.
    """

    def __init__(self, policy: IntervalPolicy, ranks: RankGroup, clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(policy, IntervalPolicy):
            raise TypeError(f"save_interval must be an interval policy (EverySteps, ...), got {type(policy).__name__}")
        self.policy = policy
        self.ranks = ranks
        self.clock = clock
        self._target: Decision | None = None
        self._decisions = 0
        self._anchor: int | None = None
        # Rank 0's measurements: the window since its last decision (clock, step, save seconds).
        self._window: tuple[float, int, float] | None = None
        self._measured = Measured()

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
                step_s = max((now - start - blocked) / (step - start_step), TINY_S)
                measured = Measured(step_s, measured.save_s)
        self._window = (now, step, 0.0)
        self._measured = measured
        return measured

    def _decide(self, step: int) -> None:
        n = self._decisions
        self._decisions += 1
        if not self.policy.measured:
            self._target = self._next(step, Measured())
            return
        what = f"receive the decision whether to save at step {step} for {self.ranks.name} (should_save)"
        key = f"next_save/{n}"
        raw = self.ranks.decided(what, key, lambda: self._next(step, self._measure(step, self.clock())).to_bytes())
        self._target = Decision.from_bytes(raw, key)

    def _next(self, step: int, measured: Measured) -> Decision:
        """The policy's decision at ``step`` (on rank 0 for a measured policy, else on every rank)."""
        assert self._anchor is not None
        target = self.policy.next_save(step, min(self._anchor, step), measured)
        decision = Decision(step + PROBE_STEPS, "decide") if target is None else Decision(target, "save")
        logger.debug(
            "save schedule %s: decision %d at step %d: %s (%s)",
            self.policy,
            self._decisions - 1,
            step,
            decision,
            measured,
        )
        return decision


__all__ = ["PROBE_STEPS", "Decision", "SaveSchedule"]
