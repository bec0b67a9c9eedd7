"""Old import path of :mod:`uc_checkpoint.ops.manager`, kept for one release: importing it gives
that very module (same objects, so private names, patches and pickles keep working)."""

import sys

from uc_checkpoint.ops import manager as _moved

sys.modules[__name__] = _moved
