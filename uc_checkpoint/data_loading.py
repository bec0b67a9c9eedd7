"""Old import path of :mod:`uc_checkpoint.data.loading`, kept for one release."""

import sys
from typing import TYPE_CHECKING

from uc_checkpoint.data import loading as _moved

if TYPE_CHECKING:  # type checkers do not see the swap below
    from uc_checkpoint.data.loading import *  # noqa: F403

# The old name becomes the very same module object: private names, monkeypatching and pickled class
# paths (uc_checkpoint.data_loading.X) keep working.
sys.modules[__name__] = _moved
