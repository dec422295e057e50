"""steadyserve: a PyTorch language-model server that stays correct under load."""

import os as _os

__version__ = "0.1.0"

# MKL's strict conditional-numerical-reproducibility mode, before any BLAS call of
# this process (MKL reads it once): GEMM rows then stop depending on the row count
# (M >= 4 on the machines seen) and on the thread count. The row tiler verifies
# this at start-up rather than trusting it; an operator's own setting wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
