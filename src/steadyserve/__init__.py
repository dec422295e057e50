"""steadyserve: a PyTorch language-model server that stays correct under load."""

import os as _os

__version__ = "0.1.0"

from .numerics import apply_env as _apply_env

# MKL's strict conditional-numerical-reproducibility mode for the host numerics path, before any BLAS
# call of this process: MKL reads it once. In strict mode GEMM rows stop depending on the row count
# (M >= 4 on the machines seen) and on the thread count; the row tiler verifies this at start-up
# rather than trusting it. The native paths (int8, the default, and portable) do not use MKL.
# An operator's own MKL_CBWR wins, and the fingerprint's numerics id names it (see numerics.py).
_apply_env()
