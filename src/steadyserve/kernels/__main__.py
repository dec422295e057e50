"""`python -m steadyserve.kernels`: build the native kernels now (make install, the Dockerfile)."""

import sys

from .build import load

status = load()
print(status.detail)
sys.exit(0 if status.available else 1)
