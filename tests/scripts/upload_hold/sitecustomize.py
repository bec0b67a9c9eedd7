"""Test hook for the example-job tests: holds one checkpoint's uploads so a kill lands while they are
in flight (deterministically, instead of hoping a kill after ``async_save`` returns is early enough).

Python imports ``sitecustomize`` at start-up from ``sys.path``; the tests put this directory on
``PYTHONPATH`` of one torchrun agent (a "node"), so its ranks, and only theirs, are held. With
``UC_TEST_HOLD_UPLOAD=<substring of a checkpoint location>`` (e.g. ``step_00000009``) each upload of
a data file into a matching location first creates ``$UC_TEST_HOLD_DIR/upload-started-<pid>`` and
then waits while ``$UC_TEST_HOLD_DIR/hold`` exists (at most ``UC_TEST_HOLD_MAX_S`` seconds, default
60). Without the variable it does nothing. The volume, the upload and the kill stay real.
"""

from __future__ import annotations

import os

if os.environ.get("UC_TEST_HOLD_UPLOAD"):
    import time
    from pathlib import Path

    from uc_checkpoint.volumes.local import LocalVolume

    _pattern = os.environ["UC_TEST_HOLD_UPLOAD"]
    _dir = Path(os.environ["UC_TEST_HOLD_DIR"])
    _max_s = float(os.environ.get("UC_TEST_HOLD_MAX_S", "60"))
    _upload = LocalVolume.upload_file

    def _held_upload(self, local_path, name, **kwargs):
        if _pattern in self.url:
            (_dir / f"upload-started-{os.getpid()}").touch()
            deadline = time.monotonic() + _max_s
            while (_dir / "hold").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return _upload(self, local_path, name, **kwargs)

    LocalVolume.upload_file = _held_upload  # type: ignore[method-assign]
