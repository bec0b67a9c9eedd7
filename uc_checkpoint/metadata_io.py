"""Old import path of :mod:`uc_checkpoint.dcp.metadata_io`, kept for one release: importing it gives
that very module (same objects, so private names, patches and pickles keep working)."""

import sys

from uc_checkpoint.dcp import metadata_io as _moved

sys.modules[__name__] = _moved
