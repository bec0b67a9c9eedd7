"""Old import path of :mod:`uc_checkpoint.dcp.compat`, kept for one release: importing it gives
that very module (same objects, so private names, patches and pickles keep working)."""

import sys

from uc_checkpoint.dcp import compat as _moved

sys.modules[__name__] = _moved
