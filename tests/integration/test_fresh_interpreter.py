"""What a fresh interpreter (a ``python -c`` child process) sees that an imported test module cannot:
the package, its errors, and the data and format packages import without torch, and without the ``isal`` wheel the CRC-32 falls
back to zlib's with the same results."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_the_package_its_errors_and_the_data_package_import_no_torch() -> None:
    """A data-pipeline process, or a tool that only inspects tracker states, does not pay for torch."""
    done = _run(
        "import sys\n"
        "import uc_checkpoint, uc_checkpoint.errors\n"
        "import uc_checkpoint.data.tracker, uc_checkpoint.data.state, uc_checkpoint.data.intervals\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
        "from uc_checkpoint import DatasetMismatchError, UCCheckpointError\n"
        "assert issubclass(DatasetMismatchError, UCCheckpointError)\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_format_package_and_layout_do_not_import_torch() -> None:
    done = _run("import sys, uc_checkpoint.format.manifest, uc_checkpoint.format.layout; print('torch' in sys.modules)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", done.stderr


def test_crc32_falls_back_to_zlibs_where_isal_does_not_import() -> None:
    done = _run(
        "import sys, zlib; sys.modules['isal'] = None\n"  # as if no wheel had installed
        "from uc_checkpoint.format import integrity\n"
        "assert integrity._crc32 is zlib.crc32\n"
        "d = integrity.Digest(block_size=7); d.update(b'abc' * 10); d.close()\n"
        "assert d.record('f').crc32 == format(zlib.crc32(b'abc' * 10), '08x'), d.record('f')\n"
    )
    assert done.returncode == 0, done.stderr
