"""Preemption notices: a signal handler that only sets a flag, for the training loop to poll.

Schedulers and spot/preemptible VMs send SIGTERM some seconds before they kill a job. Nothing can be
saved from inside a signal handler (collectives and file I/O are not safe there), so the handler
records the signal and the training loop, at its next step boundary, asks every rank whether any of
them was told (:meth:`uc_checkpoint.ops.ranks.RankGroup.any_rank`) and then takes a final save together
(:meth:`uc_checkpoint.ops.manager.CheckpointManager.save_final`).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any


class PreemptionNotice:
    """The flag a preemption signal sets, and the handlers it replaced.

    One per :class:`~uc_checkpoint.ops.manager.CheckpointManager` (no global state: two managers in one
    process each keep their own flag, the last installed handler receives the signal).
    """

    def __init__(self) -> None:
        #: The number of the last signal received, or None.
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def received(self) -> bool:
        """Whether this process received one of the signals."""
        return self.signal is not None

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """Handle ``signals`` by setting the flag; the handlers they had are kept for
        :meth:`uninstall` (installing twice keeps the first ones). Call from the main thread
        (``signal.signal`` raises ``ValueError`` elsewhere)."""
        for sig in signals:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Restore the handlers :meth:`install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum


__all__ = ["PreemptionNotice"]
