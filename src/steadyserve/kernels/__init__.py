"""Native CPU kernels (C++, built with torch.utils.cpp_extension) and their fallbacks.

`load()` builds the extension once into a cache (keyed by the source, torch
version and flags) and registers `torch.ops.steadyserve.*`. When it cannot be
built (no compiler, no ninja) the engine falls back to the Python path, says so
at start-up, and the fingerprint names the kernel in use, since the two paths
differ bitwise.
"""

from .build import KernelStatus, float_build, int8_build, kernel_status, load, register_rows

__all__ = ["KernelStatus", "float_build", "int8_build", "kernel_status", "load", "register_rows"]
