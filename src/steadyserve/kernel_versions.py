"""One table of the native kernels' versions, from which the fingerprint's numerics ids are derived.

Each family's version names its reduction order (the comment at the top of its C++ sources). Bump a
version whenever a family rounds differently: every numerics path that names the family then gets a new
id (numerics.py hashes `kernels_of(path)`), so a fingerprint cannot stay the same while the bits change.
Torch-free on purpose: numerics.py reads it before torch is imported (MKL's environment comes first).
"""

from __future__ import annotations

# family -> version of its reduction order
KERNELS: dict[str, str] = {
    "attention": "nat1",  # csrc/paged_attention.cpp: fma dot products, 16-lane exp sums
    "matmul": "qmm1",  # csrc/qmm.h: float32 activations, 16 fma lanes over K, one fixed lane tree
    "int8": "q8a1",  # csrc/q8.h: int8 activations per 32, exact integer block sums, one float chain per output
}

# numerics path -> the families whose bits it stands for, in the order its id names them
PATH_KERNELS: dict[str, tuple[str, ...]] = {
    "portable": ("matmul", "attention"),
    "int8": ("int8", "matmul", "attention"),  # matmul: F16/BF16/F32 matrices and the row-wise ops
}


def kernels_of(path: str) -> str:
    """The kernel ids a numerics path's id stands for, e.g. "qmm1+nat1"."""
    return "+".join(KERNELS[family] for family in PATH_KERNELS[path])
