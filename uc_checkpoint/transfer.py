"""Old import path of :mod:`uc_checkpoint.engine.transfer`, kept for one release: importing it gives
that very module (same objects, so private names, patches and pickles keep working)."""

import sys

from uc_checkpoint.engine import transfer as _moved

sys.modules[__name__] = _moved
