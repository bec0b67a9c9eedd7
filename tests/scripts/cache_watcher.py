"""A second process watching a checkpoint root through a filesystem that caches listings (see
tests/support/caching_fs.py), as an evaluation job or a restarted rank watches the training job's root.

Usage: cache_watcher.py ROOT_URL    then, one command per line on stdin:
``latest`` prints ``LATEST <step or None>``; ``list`` prints ``LIST <step>,<step>,...``; ``quit``
(or end of input) exits 0.
"""

from __future__ import annotations

import sys
import warnings

import tests.support.caching_fs  # noqa: F401 - registers the uccache:// and uccachenr:// protocols
from uc_checkpoint.dcp.options import Staging
from uc_checkpoint.ops.manager import CheckpointManager

warnings.filterwarnings("ignore")


def main() -> int:
    manager = CheckpointManager(sys.argv[1], staging=Staging(mode="sync"))
    for line in sys.stdin:
        command = line.strip()
        if command == "latest":
            print(f"LATEST {manager.latest()}", flush=True)
        elif command == "list":
            print("LIST " + ",".join(str(i.step) for i in manager.list()), flush=True)
        elif command == "quit":
            break
        else:
            print(f"UNKNOWN {command}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
