"""A module to preload in the forkserver template: records the thread-pool variables.

``SEEN`` maps each variable native libraries size their thread pools by to
its value in the environment this import ran in (None: unset).
"""

from __future__ import annotations

import os

SEEN = {
    var: os.environ.get(var)
    for var in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "BLIS_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS",
    )
}
