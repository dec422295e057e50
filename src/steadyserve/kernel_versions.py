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
    # csrc/q8.h: int8 activations per 32, exact integer block sums, one float chain per output. q8a2: a block whose
    # amax is below 2^-64 is scaled by 2^64 before 127 / amax (which overflowed below ~3.7e-37, and each build then
    # stored its own garbage); every other block keeps q8a1's bits. q8a5: the LM head multiplies each row's rounding
    # residual as a second int8 row on the panels near the row's largest output (q8.h, "Residual rows"); every other
    # matrix keeps q8a2's bits. (q8a3 named a per-256 order measured on a branch and never merged; q8a4 the residual
    # rows on every panel, merged and reverted for their cost.)
    "int8": "q8a5",
}

# KV cache storage format (--kv-cache-dtype) -> version of its rounding on write and of the attention kernel's
# exact read of it (csrc/kv_format.h, kv_write.cpp). The fingerprint names it wherever the cache is not stored
# in the activations' own dtype (the float32 cache, which "attention" above already stands for).
KV_FORMATS: dict[str, str] = {
    "fp32": "kvf1",  # the float itself
    "f16": "kvh1",  # IEEE binary16, round to nearest even
    "bf16": "kvb1",  # bfloat16, round to nearest even
    # llama.cpp's q8_0: d = amax / 127 as f16, q = roundf(x * (1 / d)), per 32 values. kvq2: keys in quads of dims,
    # and scores as exact integer dot products with the queries in q8_0 (paged_attention.cpp's step 1'), where kvq1
    # read each key back as a float
    "q8_0": "kvq2",
}

# numerics path -> the families whose bits it stands for, in the order its id names them
PATH_KERNELS: dict[str, tuple[str, ...]] = {
    "portable": ("matmul", "attention"),
    "int8": ("int8", "matmul", "attention"),  # matmul: F16/BF16/F32 matrices and the row-wise ops
}


def kernels_of(path: str) -> str:
    """The kernel ids a numerics path's id stands for, e.g. "qmm1+nat1"."""
    return "+".join(KERNELS[family] for family in PATH_KERNELS[path])


def kv_format_id(fmt: str, activations_fmt: str) -> str:
    """The fingerprint's name for a KV storage format; "" where the cache stores the activations' own dtype."""
    return "" if fmt == activations_fmt else KV_FORMATS[fmt]


def kv_format_named(fingerprint: str) -> str:
    """The KV storage format a fingerprint names ("f16", "bf16", "q8_0", "fp32"), or "" where it names none:
    then the cache stored the activations' own dtype."""
    by_id = {v: k for k, v in KV_FORMATS.items()}
    return next((by_id[part] for part in fingerprint.split("-") if part in by_id), "")
