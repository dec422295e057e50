"""cos and sin of RoPE angles by one fixed sequence of IEEE float64 additions and multiplications.

Why not `Tensor.cos()`: PyTorch routes float transcendentals through whatever its build picks (MKL's VML,
SLEEF, the C library), chosen by CPU and by process state. On an Intel Xeon, one process in about fifteen
that loaded a model while its other thread was contended got a float32 cos table off by about 1.5e-4
from position 1 on (the sin table beside it exact): every logprob of that process then differed from the
published receipts. A RoPE table feeds every layer, so its bits are part of the numerics promise and get
the same treatment as the kernels: one documented order of operations, nothing a library or CPU can change.

The method (fdlibm's, in vectorised torch float64 ops; each op is a single IEEE-rounded add, subtract,
multiply or round-to-integer, which every x86-64 CPU computes identically, and torch never fuses them):
1. k = round(x * 2/pi); r = x - k*P1 - k*P2 - k*P3, with pi/2 = P1 + P2 + P3 split so that k*P1 and
   k*P2 are exact for k < 2^20 (angles below 1.6e6 rad: positions times inv_freq <= 1, so 1.6M positions).
2. sin(r) and cos(r) on |r| <= pi/4 by fdlibm's minimax polynomials (__kernel_sin, __kernel_cos: error
   below 2^-58 there), evaluated by Horner's rule, left to right as written.
3. The quadrant k mod 4 picks +-sin(r) or +-cos(r); the result is multiplied by `scaling` in float64
   and rounded to float32 once.
The float32 results are the correctly rounded values except where the true value lies within about
2^-52 (relative) of a float32 rounding boundary; they are the same bits on every machine either way.
"""

from __future__ import annotations

import torch

# pi/2 = _P1 + _P2 + _P3 (fdlibm's pio2_1, pio2_2, pio2_2t): _P1 and _P2 carry 33 significant bits.
_P1 = 1.57079632673412561417e+00
_P2 = 6.07710050630396597660e-11
_P3 = 2.02226624879595063154e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_MAX_ANGLE = float(2 ** 20)  # k below 2^20: k * _P1 and k * _P2 are exact
# Angles per pass: the block's float64 temporaries (128 KiB each) stay in the caches, and each op stays below
# torch's parallel grain (32768 elements), so it runs on the calling thread: an op split over 2 OpenMP threads
# waits at its end for the slower one, and on a shared CPU a descheduled thread made blocks of 65536 take 10-24 s
# where 16384 took under a second.
_BLOCK = 1 << 14

# fdlibm __kernel_sin: sin(r) = r + r^3 * (S1 + z*(S2 + z*(S3 + z*(S4 + z*(S5 + z*S6))))), z = r^2
_SIN = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
        2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
# fdlibm __kernel_cos: cos(r) = 1 - z/2 + z^2 * (C1 + z*(C2 + z*(C3 + z*(C4 + z*(C5 + z*C6)))))
_COS = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
        -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)


def _horner(z: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """c0 + z*(c1 + z*(c2 + ...)), innermost first: one rounding per multiply and per add."""
    acc = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc


def cos_sin(angles: torch.Tensor, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos(angles) * scaling and sin(angles) * scaling, the same bits on every machine.

    angles: float32 or float64, any shape, 0 <= angle < 2^20 (ValueError otherwise).
    Returns two float32 tensors of the angles' shape.
    """
    x = angles.to(torch.float64)
    if x.numel() and not (bool((x >= 0).all()) and float(x.max()) < _MAX_ANGLE):
        raise ValueError(f"RoPE angles must lie in [0, 2^20) for the fixed cos/sin; got [{float(x.min())}, "
                         f"{float(x.max())}]")
    flat = x.reshape(-1)
    cos_out = torch.empty(flat.shape, dtype=torch.float32)
    sin_out = torch.empty(flat.shape, dtype=torch.float32)
    # Block by block: each op of the method is one pass over its inputs, so a whole 128k-position table made
    # every pass read and write arrays far larger than the caches (about 14x slower). Elementwise ops: the
    # blocks change no value.
    for start in range(0, flat.numel(), _BLOCK):
        c, s = _cos_sin_block(flat[start:start + _BLOCK], scaling)
        cos_out[start:start + _BLOCK] = c
        sin_out[start:start + _BLOCK] = s
    return cos_out.view(x.shape), sin_out.view(x.shape)


def _cos_sin_block(x: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.round(x * _TWO_OVER_PI)  # round half to even, exact on integers below 2^53
    r = ((x - k * _P1) - k * _P2) - k * _P3  # |r| <= pi/4 (+ a few ulps)
    z = r * r
    sin_r = r + (r * z) * _horner(z, _SIN)
    cos_r = (1.0 - 0.5 * z) + (z * z) * _horner(z, _COS)
    quadrant = torch.remainder(k, 4.0)  # 0, 1, 2 or 3: exact
    # cos(x) over quadrants: cos r, -sin r, -cos r, sin r; sin(x): sin r, cos r, -sin r, -cos r
    odd = (quadrant == 1.0) | (quadrant == 3.0)
    cos_mag = torch.where(odd, sin_r, cos_r)
    sin_mag = torch.where(odd, cos_r, sin_r)
    cos_neg = (quadrant == 1.0) | (quadrant == 2.0)
    sin_neg = quadrant >= 2.0
    cos_x = torch.where(cos_neg, -cos_mag, cos_mag)
    sin_x = torch.where(sin_neg, -sin_mag, sin_mag)
    return (cos_x * scaling).to(torch.float32), (sin_x * scaling).to(torch.float32)
