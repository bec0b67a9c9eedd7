"""Old import path of :mod:`uc_checkpoint.data.tracker`, kept for one release."""

import sys
from typing import TYPE_CHECKING

from uc_checkpoint.data import tracker as _moved

if TYPE_CHECKING:  # type checkers do not see the swap below
    from uc_checkpoint.data.tracker import *  # noqa: F403

# The old name becomes the very same module object: private names, monkeypatching and pickled class
# paths (uc_checkpoint.data_tracker.X) keep working.
sys.modules[__name__] = _moved
