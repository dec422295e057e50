"""The LM head's order in the int8 family (kernels/csrc/q8.h, "Residual rows"): each activation row is quantized,
its rounding residual r = x - q dx is quantized as a second row, and on the panels of 16 outputs that hold one within
a margin of the row's largest (at most a given number of them, the largest first), the residual row's outputs are
added.

What it promises, on any x86-64 machine:
* the result is the documented one: rows of the ordinary int8 product (qmatmul_, itself checked in test_q8.py), the
  value's everywhere and the residual's added in float32 on exactly the panels the margin selects, bitwise, for
  every packable format and margin (none, some, every panel);
* a row's bits depend on nothing else: not on M, the thread count, the build (scalar, AVX2, AVX-512 VNNI, AMX: the
  ones /proc/cpuinfo lists) or the output column it starts at;
* the residual row does its job: the error against exact arithmetic on the float activations is a small fraction
  of one int8 row's;
* a non-finite activation poisons its own row only. (test_int8_engine.py checks that the int8 path's LM head, and
  only it, multiplies this way.)
"""

from __future__ import annotations

import math

import pytest
import torch
from cpu_builds import INT8_BUILDS, NAMES
from test_q8 import PACKABLE_NAMES, _bits, _mm
from test_qmm import _qweight, _reference_values

from steadyserve.kernels import load
from steadyserve.kernels.build import load_test_ops
from steadyserve.kernels.quant import FORMAT_IDS, PACKED, QMatrix

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")
OPS = torch.ops.steadyserve
if load().available:
    load_test_ops()  # q8quantize
BUILDS = INT8_BUILDS  # from /proc/cpuinfo, not from the kernels' own detection (cpu_builds.py)


NO_CAP = 1 << 40  # max_panels that no matrix reaches


def _residual_mm(packed: torch.Tensor, fmt: int, x: torch.Tensor, margin: float = math.inf, isa: int = -1,
                 col0: int = 0, width: int | None = None, max_panels: int = NO_CAP) -> torch.Tensor:
    y = torch.full((x.shape[0], width or packed.shape[0]), float("nan"))  # an unwritten output is not equal
    OPS.q8matmul_residual_(x.contiguous(), packed, PACKED + fmt, y, col0, margin, max_panels, isa)
    return y


def _documented(packed: torch.Tensor, fmt: int, x: torch.Tensor, margin: float, max_panels: int = NO_CAP) -> torch.Tensor:
    """q8.h's residual rows from the parts test_q8.py checks: the scalar build's quantization of x, the residual in
    torch's IEEE float32 (a multiply, then a subtract), the scalar build's product of each row, and the residual's
    outputs added on the panels holding an output within `margin` of the row's largest: at most `max_panels` of
    them per row, those with the largest outputs, a tie to the lower panel."""
    xq, dx = OPS.q8quantize(x, 0)
    m, k = x.shape
    r = x - (xq.float().view(m, k // 32, 32) * dx[..., None]).view(m, k)
    y_x, y_r = _mm(packed, fmt, x, 0), _mm(packed, fmt, r, 0)
    tops = y_x.view(m, -1, 16).max(-1).values  # (M, panels)
    near = tops >= (y_x.max(1, keepdim=True).values - margin)
    for i in range(m):
        chosen = [int(p) for p in near[i].nonzero().flatten()]
        if len(chosen) > max_panels:
            keep = sorted(chosen, key=lambda p: (-float(tops[i, p]), p))[:max_panels]
            near[i] = False
            near[i, keep] = True
    return torch.where(near.repeat_interleave(16, 1), y_x + y_r, y_x)


@pytest.mark.parametrize("isa", BUILDS, ids=[NAMES[b] for b in BUILDS])
@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_residual_rows_are_the_documented_rows_on_every_build_m_thread_count_and_margin(name, isa):
    fmt = FORMAT_IDS[name]
    threads = torch.get_num_threads()
    k = 512 if name.endswith("_K") else 96  # K-quants: whole super-blocks; else an odd count of blocks
    qw = _qweight(fmt, 400, k, seed=21)  # 25 panels
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.randn(70, qw.k, generator=torch.Generator().manual_seed(22)) * 3.0
    y_x = _mm(packed, fmt, x, 0)
    spread = float((y_x.max(1).values - y_x.min(1).values).median())
    try:
        for margin, cap in ((math.inf, NO_CAP), (spread / 4, NO_CAP), (0.0, NO_CAP), (math.inf, 3)):
            # every panel; some; the largest output's panel alone; the three panels with the largest outputs
            want = _documented(packed, fmt, x, margin, cap)
            assert not torch.equal(want, y_x), (name, margin)  # some panel is corrected, so an uncorrected op fails
            if margin == spread / 4 or cap == 3:
                assert not torch.equal(want, _documented(packed, fmt, x, math.inf)), name  # and only some are
            for n_threads in sorted({1, threads}):
                torch.set_num_threads(n_threads)
                got = _residual_mm(packed, fmt, x, margin, isa, max_panels=cap)
                assert torch.equal(_bits(got), _bits(want)), (name, isa, n_threads, margin, cap)
                for rows in (1, 2, 3, 15, 16, 17, 33, 48):
                    got = _residual_mm(packed, fmt, x[5:5 + rows], margin, isa, max_panels=cap)
                    assert torch.equal(_bits(got), _bits(want[5:5 + rows])), (name, isa, n_threads, rows, margin, cap)
                wide = _residual_mm(packed, fmt, x[:3], margin, isa, col0=16, width=qw.n + 32, max_panels=cap)
                assert torch.equal(_bits(wide[:, 16:16 + qw.n]), _bits(want[:3])), (name, isa, n_threads, margin, cap)
                assert torch.isnan(wide[:, :16]).all() and torch.isnan(wide[:, 16 + qw.n:]).all()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", BUILDS, ids=[NAMES[b] for b in BUILDS])
def test_a_wide_head_split_into_runs_per_thread_gives_the_documented_rows(isa):
    """A head as wide as a vocabulary: each thread takes its panels in runs of 64 Ki outputs and finds their largest
    right after each run (q8linear.cpp, kTopsFloats), so at M = 64 a thread's 128 panels are two runs, and a row's
    largest output may sit in a run other than the panels its margin selects. The bits are the documented ones."""
    fmt = FORMAT_IDS["Q8_0"]
    qw = _qweight(fmt, 4096, 64, seed=28)  # 256 panels
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.randn(64, qw.k, generator=torch.Generator().manual_seed(29)) * 3.0
    y_x = _mm(packed, fmt, x, 0)
    margin = float((y_x.max(1).values - y_x.min(1).values).median()) / 8
    want = _documented(packed, fmt, x, margin, max_panels=20)
    near = (want != y_x).view(64, -1, 16).any(-1)
    assert near.any() and not near.all(), "some panels and not all are corrected"
    assert not torch.equal(want, _documented(packed, fmt, x, margin)), "the cap holds some rows back"
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, 2, threads}):
            torch.set_num_threads(n_threads)
            for rows in (1, 7, 64):
                got = _residual_mm(packed, fmt, x[:rows], margin, isa, max_panels=20)
                assert torch.equal(_bits(got), _bits(want[:rows])), (isa, n_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_a_call_past_the_kept_panel_maxima_gives_the_documented_rows():
    """More (row, panel) maxima than the op keeps allocated between calls (q8linear.cpp, kKeptTops: 2^20): a scoring
    chunk's rows against a wide head take a buffer of their own, with the same bits."""
    fmt = FORMAT_IDS["Q8_0"]
    qw = _qweight(fmt, 16384, 32, seed=30)  # 1,024 panels
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.randn(1030, qw.k, generator=torch.Generator().manual_seed(31)) * 3.0  # 1,054,720 maxima
    y_x = _mm(packed, fmt, x, 0)
    margin = float((y_x.max(1).values - y_x.min(1).values).median()) / 8
    want = _documented(packed, fmt, x, margin, max_panels=20)
    assert not torch.equal(want, y_x)
    got = _residual_mm(packed, fmt, x, margin, max_panels=20)
    assert torch.equal(_bits(got), _bits(want))
    small = _residual_mm(packed, fmt, x[:64], margin, max_panels=20)  # the kept buffer again, after the fresh one
    assert torch.equal(_bits(small), _bits(want[:64]))


@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_the_residual_row_leaves_a_small_fraction_of_one_rows_error(name):
    """Exact arithmetic on the float activations against the stored weights, in float64. One int8 row is off by
    up to amax / 254 per value; the residual row quantizes that remainder to 1/254 of itself again, so the error
    left is far below a tenth of one row's (what stays is float32 rounding in the chains). A residual row that did
    nothing (r = 0, or r's outputs not added) leaves one row's error."""
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 64, 1024, seed=23)
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.randn(8, qw.k, generator=torch.Generator().manual_seed(24))
    exact = x.double() @ _reference_values(qw).double().T
    one_row = (_mm(packed, fmt, x).double() - exact).abs().mean()
    two_rows = (_residual_mm(packed, fmt, x).double() - exact).abs().mean()
    assert two_rows < one_row / 10, (name, float(one_row), float(two_rows))


def test_a_non_finite_activation_poisons_its_own_row_only():
    fmt = FORMAT_IDS["Q8_0"]
    qw = _qweight(fmt, 32, 64, seed=25)
    packed = OPS.q8pack(qw.data, fmt, 64)
    x = torch.randn(35, 64)
    x[1, 40] = float("inf")
    x[2, 3] = float("nan")
    for isa in BUILDS:
        y = _residual_mm(packed, fmt, x, isa=isa)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1:3]).all() and torch.isfinite(y[3:]).all(), isa


def test_an_unpacked_matrix_is_refused_by_name_and_a_qmatrix_keeps_its_float_parts_as_they_are():
    q8 = _qweight(FORMAT_IDS["Q8_0"], 32, 256, seed=26)
    f16 = _qweight(FORMAT_IDS["F16"], 16, 256, seed=27)
    with pytest.raises(RuntimeError, match="q8matmul_residual_: no int8 kernel"):
        OPS.q8matmul_residual_(torch.randn(2, 256), q8.data, q8.fmt, torch.empty(2, 32), 0, math.inf, 1)
    packed = OPS.q8pack(q8.data, q8.fmt, 256)
    with pytest.raises(RuntimeError, match="margin must be >= 0"):
        OPS.q8matmul_residual_(torch.randn(2, 256), packed, PACKED + q8.fmt, torch.empty(2, 32), 0, -1.0, 1)
    with pytest.raises(RuntimeError, match="max_panels must be > 0"):
        OPS.q8matmul_residual_(torch.randn(2, 256), packed, PACKED + q8.fmt, torch.empty(2, 32), 0, 1.0, 0)
    head = QMatrix([q8, f16]).packed().with_residual_rows(math.inf, NO_CAP)
    x = torch.randn(3, 256)
    y = head(x)
    assert torch.equal(_bits(y[:, :32]), _bits(_residual_mm(head.parts[0].data, FORMAT_IDS["Q8_0"], x)))
    assert torch.equal(_bits(y[:, 32:]), _bits(QMatrix([f16])(x)))  # float32 activations already: one row

