"""Weights in their stored GGUF block formats, and the native ops that compute with them.

A `QWeight` is one (N, K) weight matrix as the file stores it: N rows of K weights, each row
a run of fixed-size blocks (csrc/qmm.h lists the formats). A `QMatrix` is the concatenation
along N of several of them (q|k|v, gate|up), kept as separate parts so that each stays a
view of the file's memory mapping and parts of different formats can sit side by side
(Q4_K_M files mix Q4_K and Q6_K in one layer). Every op here runs the native matmul
family: one reduction order, whatever the rows, threads or ISA (csrc/qmm.h).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# GGML type id -> (name, weights per block, bytes per block): the formats with a kernel. csrc/formats.h owns these
# facts; tests/test_kernel_library.py holds this copy (and PACKABLE) to its records.
FORMATS: dict[int, tuple[str, int, int]] = {
    0: ("F32", 32, 128), 1: ("F16", 32, 64), 30: ("BF16", 32, 64), 8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 39: ("MXFP4", 32, 17),
}
FORMAT_IDS = {name: fmt for fmt, (name, _, _) in FORMATS.items()}
# The int8 family (csrc/q8.h) reads these formats from 16-row panels packed once at load; a packed
# matrix's format id is PACKED + its GGML type. F32/F16/BF16 stay on the float32 family.
PACKED = 256
PACKABLE = frozenset(FORMAT_IDS[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"))
# MXFP4's E8M0 exponents e whose scale 2^(e - 128) a binary16 holds exactly (csrc/formats.h): the int8 family packs
# an MXFP4 matrix only where every block's e is in this range or its 32 values are all +-0 (QWeight.packs).
MXFP4_EXPONENTS = range(104, 144)
_TORCH_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


class UnsupportedFormat(ValueError):
    """A tensor's stored type has no kernel; str() names the tensor and the type."""


@dataclass(frozen=True)
class QWeight:
    """One weight matrix in a stored block format."""

    data: torch.Tensor  # (N, row_bytes) uint8: row n holds the K weights of output column n
    fmt: int  # GGML type id (FORMATS)
    k: int  # weights per row (the matmul's K)
    name: str = ""  # the tensor's name, for errors

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def format_name(self) -> str:
        return FORMATS[self.fmt - PACKED][0] + " packed" if self.packed else FORMATS[self.fmt][0]

    @property
    def packed(self) -> bool:
        """Panels for the int8 family (csrc/q8.h), not the GGUF's rows."""
        return self.fmt >= PACKED

    @cached_property  # the packed-weight cache's plan asks, then pack(): an MXFP4 matrix's scan runs once
    def packs(self) -> bool:
        """Whether pack() makes panels of this matrix: a packable format, whole panels of 16 rows, and for MXFP4
        every block's scale exact as the binary16 the panels hold (csrc/formats.h; MXFP4_EXPONENTS), or the block
        all zeros. An MXFP4 matrix with any other block stays on the float32 family, whose decode is exact for every
        exponent: a rounded scale would change its values. Reads one byte per block (the exponents), and the
        nibbles of the blocks outside the range."""
        if self.packed or self.fmt not in PACKABLE or self.n % 16:
            return False
        if FORMATS[self.fmt][0] != "MXFP4":
            return True
        blocks = self.data.reshape(self.n, -1, 17)
        e = blocks[..., 0]
        outside = (e < MXFP4_EXPONENTS.start) | (e >= MXFP4_EXPONENTS.stop)
        return not outside.any() or not (blocks[outside][:, 1:] & 0x77).any()  # 0x77: the nibbles' magnitudes

    def pack(self) -> QWeight:
        """This matrix as the int8 family's panels (a new copy, about the GGUF's size), or itself where that
        family has no kernel for it (F16/BF16/F32, N not a multiple of 16, an MXFP4 scale no binary16 holds:
        `packs`): it stays on the float32 path."""
        if not self.packs:
            return self
        return QWeight(torch.ops.steadyserve.q8pack(self.data, self.fmt, self.k), PACKED + self.fmt, self.k, self.name)

    @staticmethod
    def from_tensor(t: torch.Tensor, name: str = "") -> QWeight:
        """A float32/float16/bfloat16 (N, K) tensor as a QWeight (the same memory, no copy)."""
        if t.dtype not in _TORCH_FORMATS:
            raise UnsupportedFormat(f"{name or 'tensor'}: dtype {t.dtype} has no native kernel")
        t = t.contiguous()
        return QWeight(t.view(torch.uint8).view(t.shape[0], -1), _TORCH_FORMATS[t.dtype], t.shape[1], name)

    def check(self) -> None:
        """Raise UnsupportedFormat unless the kernels can read this matrix."""
        if self.packed:
            return  # q8pack made it from a matrix that passed
        if self.fmt not in FORMATS:
            raise UnsupportedFormat(f"{self.name}: GGML type {self.fmt} has no native kernel "
                                    f"(supported: {', '.join(sorted(FORMAT_IDS))})")
        _, block, nbytes = FORMATS[self.fmt]
        if self.k % 32 or self.k % block or self.data.shape[1] != self.k // block * nbytes:
            raise UnsupportedFormat(f"{self.name}: {self.format_name} rows of {self.k} weights do not fit "
                                    f"the kernels (K must be a multiple of {max(block, 32)})")

    def permute_rows(self, order: torch.Tensor) -> QWeight:
        """The rows in another order (whole rows move: no value changes)."""
        return QWeight(self.data[order].contiguous(), self.fmt, self.k, self.name)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(R, K) float32: the values of `rows` (all rows by default), bitwise gguf-py's."""
        if self.packed:
            raise ValueError(f"{self.name}: packed panels are read by the int8 matmul only")
        idx = torch.arange(self.n) if rows is None else rows
        return torch.ops.steadyserve.qdequant(self.data, self.fmt, self.k, idx, -1)


class QMatrix:
    """y = x · Wᵀ for W the concatenation along N of `parts`; every part read as stored."""

    def __init__(self, parts: list[QWeight], residual_margin: float | None = None, residual_panels: int = 0) -> None:
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("a QMatrix needs parts with one K")
        for p in parts:
            p.check()
        self.parts = parts
        self.k = parts[0].k
        self.n = sum(p.n for p in parts)
        # None: one int8 row per activation row. A margin: packed parts then add each row's rounding residual as a
        # second int8 row on the panels within the margin of the row's largest output (q8.h, "Residual rows"): the
        # LM head's order, which the int8 numerics path sets (Transformer.use_int8_activations)
        self.residual_margin = residual_margin
        self.residual_panels = residual_panels  # with a margin: at most this many panels per row, the largest first

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor, isa: int = -1, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (M, K) float32 -> (M, N) float32, written into `out` (M, N) when given."""
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32) if out is None else out
        col = 0
        for p in self.parts:
            if self.residual_margin is not None and p.packed:
                torch.ops.steadyserve.q8matmul_residual_(x, p.data, p.fmt, y, col, self.residual_margin,
                                                         self.residual_panels, isa)
            else:
                torch.ops.steadyserve.qmatmul_(x, p.data, p.fmt, y, col, isa)
            col += p.n
        return y

    def with_residual_rows(self, margin: float, max_panels: int) -> QMatrix:
        """The same parts, multiplied in the LM head's order (residual_margin, residual_panels)."""
        if max_panels <= 0:
            raise ValueError(f"max_panels must be positive, not {max_panels}")
        return QMatrix(self.parts, residual_margin=margin, residual_panels=max_panels)

    def packed(self) -> QMatrix:
        """The same matrix with every part the int8 family reads packed for it (QWeight.pack); a new object,
        so a tied embedding keeps its GGUF rows for lookups while the LM head multiplies the panels.

        Neighbouring parts packed in one format become one part: a packed matrix is its panels of 16 whole rows
        one after another, so q|k|v's joined panels are q's, then k's, then v's, each computing its columns as
        before (the same bits), and one call quantizes the activations once for all of them, where separate
        parts quantized them once each (three times per layer for q|k|v, twice for gate|up)."""
        joined: list[QWeight] = []
        for p in (p.pack() for p in self.parts):
            last = joined[-1] if joined else None
            if last is not None and p.packed and last.fmt == p.fmt:
                joined[-1] = QWeight(torch.cat([last.data, p.data]), p.fmt, p.k, f"{last.name}|{p.name}")
            else:
                joined.append(p)
        return QMatrix(joined)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, K) float32 dequantized rows: an embedding lookup (single-part matrices)."""
        (part,) = self.parts
        return part.dequantize(ids)
