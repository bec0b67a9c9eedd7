"""A training loop that opts in to the preemption save: it trains until SIGTERM arrives, then takes
a final checkpoint of the step it reached and exits 0.

Usage: preempted_loop.py ROOT       prints ``STEP <n>`` per step and ``FINAL <n> <published>``.
The state at step n is ``{"w": full((64, 64), n), "step": n}``.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")


def main() -> int:
    manager = CheckpointManager(sys.argv[1], keep_last=2)
    manager.enable_preemption_save()
    step = 0
    while True:
        step += 1
        state = {"w": torch.full((64, 64), float(step)), "step": step}
        if step % 5 == 0:
            manager.save(step, state)
        print(f"STEP {step}", flush=True)
        time.sleep(0.2)
        if manager.preemption_requested():
            published = manager.save_final(step, state, budget_s=120)
            print(f"FINAL {step} {published}", flush=True)
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
