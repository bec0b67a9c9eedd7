"""Two-rank saving loop for the crash tests (run under torchrun; killed by the test).

Usage: crash_loop_2rank.py ROOT STAGING START_STEP PHASE_FILE CONFIRMED_FILE SEED
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from tests.support.crash_loop import save_loop

if __name__ == "__main__":
    root, staging, start, phase_file, confirmed, seed = sys.argv[1:7]
    dist.init_process_group("gloo")
    save_loop(root, staging, int(start), phase_file, confirmed, int(seed))
