"""How the OpenMP runtime's idle threads wait: a brief spin, unless the user chose otherwise.

torch's CPU build runs its parallel regions (oneDNN GEMMs, our native kernels) on libgomp.
Between regions libgomp's team threads spin for ``GOMP_SPINCOUNT`` (300,000 by default)
before they sleep. On a machine whose cores are busy with other work, a team that spins
holds its cores against the very thread it waits for: each of the hundreds of parallel
regions of a decode step then waits for a scheduler slice, and a 2-second generation took
40 s. libgomp lowers the spin only when it sees more of its own threads than cores (which is
why the same call was fast on a worker thread), never for other processes' load. loraplex
sets that throttled spin (``GOMP_SPINCOUNT=1000``) for every thread: idle threads hand over
quickly between back-to-back regions, then sleep instead of holding a core. A fully passive
wait (no spin) was 16-19% slower; ``benchmarks/openmp_wait.py`` measures all three.

libgomp reads these variables once, when torch loads it, so :func:`apply_defaults` runs
from ``loraplex/__init__.py``, before any module of ours imports torch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Container, MutableMapping

# Either variable set by the user is their choice of wait, and is kept as it is.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# libgomp's own spin count for a team with more threads than cores.
DEFAULT_SPIN_COUNT = "1000"


def apply_defaults(environ: MutableMapping[str, str] = os.environ,
                   loaded: Container[str] = sys.modules) -> bool:
    """Sets ``GOMP_SPINCOUNT=1000`` where the user set no wait variable; True if set.
    Where torch is in ``loaded`` already, libgomp will not read it: that is logged."""
    if any(name in environ for name in WAIT_VARIABLES):
        return False
    environ["GOMP_SPINCOUNT"] = DEFAULT_SPIN_COUNT
    if "torch" in loaded:
        logging.getLogger("loraplex").warning(
            "torch was imported before loraplex, so OpenMP keeps spinning idle threads; "
            "import loraplex first or set GOMP_SPINCOUNT=1000 (see loraplex/openmp.py)")
    return True
