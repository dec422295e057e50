"""The int8 matmul family (kernels/csrc/q8.h): int8 activations, packed weights, exact integer sums.

What it promises, on any x86-64 machine:
* an activation block's int8 values and scale follow the documented rule from that block alone
  (amax / 127, round-half-even of x * (127 / amax)), bitwise;
* a row's result does not depend on M, on the thread count or on the build: the AVX2, AVX-512 VNNI
  and AMX builds equal the scalar reference bitwise, for every packable format, every M from 1 past
  two AMX tiles (whole tiles of 16 from 32 rows on, the rest in VNNI) and odd block counts;
* the integer sums are the exact dot products of the quantized activations with the stored
  weights: the result equals float64 arithmetic on the dequantized operands to float32 rounding;
* a matrix the family cannot read (F16, or N not a multiple of 16) stays on the float32 path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cpu_builds import INT8_BUILDS, NAMES
from test_qmm import _qweight, _reference_values, documented_matmul, fma32

from steadyserve.kernels import load
from steadyserve.kernels.build import load_test_ops
from steadyserve.kernels.quant import FORMAT_IDS, FORMATS, PACKABLE, PACKED, QMatrix, QWeight

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")
gguf = pytest.importorskip("gguf")
OPS = torch.ops.steadyserve
if load().available:
    load_test_ops()  # q8quantize, qlog_softmax, kv_*: the test-only ops' own library
BUILDS = INT8_BUILDS  # from /proc/cpuinfo, not from the kernels' own detection (cpu_builds.py)
PACKABLE_NAMES = sorted(n for n, f in FORMAT_IDS.items() if f in PACKABLE)


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8.h's activation rule in torch's IEEE float32 operations (torch.round is half-even)."""
    m, k = x.shape
    b = x.view(m, k // 32, 32)
    amax = b.abs().amax(-1)
    scale = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(b * scale[..., None]).to(torch.int8).view(m, k), amax / 127.0


def _mm(packed: torch.Tensor, fmt: int, x: torch.Tensor, isa: int = -1) -> torch.Tensor:
    y = torch.full((x.shape[0], packed.shape[0]), float("nan"))  # a row the kernel did not write is not equal
    OPS.qmatmul_(x.contiguous(), packed, PACKED + fmt, y, 0, isa)
    return y


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_activation_quantization_follows_the_documented_rule_bitwise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=g) * torch.logspace(-6, 3, 9)[:, None]
    x[3, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    x[4, :32] = torch.arange(-16, 16) + 0.5  # amax 15.5: 2.5 * (127 / 15.5) is no tie, but ...
    x[4, 0], x[4, 1], x[4, 2] = 127.0, 2.5, -3.5  # ... with amax 127 the scale is 1: ties, which go to even
    x[6, 64:96] = torch.arange(32) - 15.75  # exact halves after scaling: 127 / 16.25 is not exact, so mixed
    ref_q, ref_d = _reference_quantize(x)
    for isa in BUILDS:  # each build's own quantization
        xq, dx = OPS.q8quantize(x, isa)
        assert torch.equal(xq, ref_q), isa
        assert torch.equal(_bits(dx), _bits(ref_d)), isa
        assert int(xq.abs().max()) <= 127
        assert xq[4, 1] == 2 and xq[4, 2] == -4  # half-even, not half away from zero


@pytest.mark.parametrize("isa", BUILDS, ids=[NAMES[b] for b in BUILDS])  # each build its own case in the report
@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_a_rows_bits_do_not_depend_on_m_threads_or_the_build(name, isa):
    fmt = FORMAT_IDS[name]
    threads = torch.get_num_threads()
    # K = 96: an odd count of blocks (AMX takes them two at a time), K = 32 one block; K-quants need super-blocks of 256
    for k in ((512,) if name.endswith("_K") else (512, 96, 32)):
        qw = _qweight(fmt, 48, k, seed=2)
        packed = OPS.q8pack(qw.data, fmt, qw.k)
        x = torch.randn(70, qw.k, generator=torch.Generator().manual_seed(3))
        full = _mm(packed, fmt, x, 0)  # the scalar reference, all rows at once
        try:
            for n_threads in sorted({1, threads}):
                torch.set_num_threads(n_threads)
                assert torch.equal(_bits(_mm(packed, fmt, x, isa)), _bits(full)), (name, k, isa, n_threads)
                for rows in (*range(1, 35), 47, 48, 49, 64):  # each tile height, its tails, AMX's threshold
                    got = _mm(packed, fmt, x[5:5 + rows], isa)
                    assert torch.equal(_bits(got), _bits(full[5:5 + rows])), (name, k, isa, n_threads, rows)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_a_large_matrix_gives_the_scalar_builds_rows_at_every_m(name):
    """N = 8192, K = 512: each of two threads reads more than 1 MiB of weights, where the AMX build runs the whole
    tiles of a call of 48 or more rows as passes of 32 over its panels (q8_amx.cpp, kPassRows); the rows stay the
    scalar build's."""
    fmt = FORMAT_IDS[name]
    threads = torch.get_num_threads()
    qw = _qweight(fmt, 8192, 512, seed=4)
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.randn(64, qw.k, generator=torch.Generator().manual_seed(5))
    full = _mm(packed, fmt, x, 0)
    try:
        for isa in BUILDS[1:]:
            for n_threads in sorted({1, 2, threads}):
                torch.set_num_threads(n_threads)
                for rows in (16, 33, 47, 48, 64):
                    got = _mm(packed, fmt, x[:rows], isa)
                    assert torch.equal(_bits(got), _bits(full[:rows])), (name, isa, n_threads, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_the_integer_sums_are_exact_dot_products_of_the_quantized_operands(name):
    """float64 on dequantized int8 activations and dequantized weights: equal to float32 rounding. A wrong zero
    point, minimum, sub-scale or nibble order is off by a whole weight's contribution, far beyond it."""
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 32, 512, seed=4)
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.randn(6, qw.k, generator=torch.Generator().manual_seed(5))
    xq, dx = OPS.q8quantize(x)
    x_dq = (xq.view(6, -1, 32).double() * dx.double()[..., None]).view(6, -1)
    ref = x_dq @ _reference_values(qw).double().T
    got = _mm(packed, fmt, x).double()
    scale = (x_dq.abs() @ _reference_values(qw).double().abs().T)  # the sum of |terms|: the rounding's scale
    assert ((got - ref).abs() <= 1e-6 * scale + 1e-30).all(), name


# Each format's stored-integer bytes within its GGUF block: set to EXTREME, every stored integer is its largest
# (15, 31, 63), or for Q8_0 -128 (|w| = 128, the sign trick's largest operand). The scale fields stay sane.
QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q8_0": (2, 34), "Q4_K": (16, 144),
               "Q5_K": (16, 176), "Q6_K": (0, 192), "MXFP4": (1, 17)}
EXTREME = {"Q8_0": 0x80, "MXFP4": 0x77}  # MXFP4: nibble 7, kvalue 12, the largest stored u = 28


@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_the_largest_integer_sums_do_not_overflow_a_builds_partial_sums(name):
    """A build may add integer products in lanes narrower than int32 (AVX2: int16, up to kSumRun quads before
    widening; q8_avx2.cpp shows the bounds). With every stored integer at its largest and every activation at +-127,
    each sum is its format's bound; a run one quad too long wraps and the row differs from the scalar build's."""
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 32, 512, seed=14)
    start, end = QUANT_BYTES[name]
    blocks = qw.data.view(qw.n, qw.k // FORMATS[fmt][1], FORMATS[fmt][2])
    blocks[..., start:end] = EXTREME.get(name, 0xFF)
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = torch.ones(8, qw.k)
    x[1::2] = -1.0  # every q = +127, or -127: the products all of one sign
    x[2, :256] = -1.0  # and a row of both
    want = _mm(packed, fmt, x, 0)
    assert torch.isfinite(want).all()
    for isa in BUILDS[1:]:
        for rows in (1, 3, 8):  # decode's one row and the tiles' heights
            assert torch.equal(_bits(_mm(packed, fmt, x[:rows], isa)), _bits(want[:rows])), (name, isa, rows)


@pytest.mark.parametrize("name", PACKABLE_NAMES)
def test_the_error_against_float32_activations_is_the_quantization_step(name):
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 64, 1024, seed=6)
    x = torch.randn(4, qw.k, generator=torch.Generator().manual_seed(7))
    exact = x.double() @ _reference_values(qw).double().T
    got = _mm(OPS.q8pack(qw.data, fmt, qw.k), fmt, x).double()
    # per block, |x - q dx| <= dx / 2 = amax / 254: relative to the sum of |terms| the error is below 1/254
    scale = x.double().abs() @ _reference_values(qw).double().abs().T
    assert ((got - exact).abs() <= scale / 254).all(), name


def test_non_finite_activations_give_nan_outputs_not_garbage():
    fmt = FORMAT_IDS["Q4_0"]
    qw = _qweight(fmt, 16, 64, seed=8)
    x = torch.randn(35, 64)  # 35 rows: the AMX build's tiles too
    x[1, 40] = float("inf")
    x[2, 3] = float("nan")
    for isa in BUILDS:
        y = _mm(OPS.q8pack(qw.data, fmt, 64), fmt, x, isa)
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1:3]).all() and torch.isfinite(y[3:]).all(), isa


def test_what_the_family_cannot_read_stays_on_the_float32_path():
    q4 = _qweight(FORMAT_IDS["Q4_1"], 48, 256, seed=9)
    f16 = _qweight(FORMAT_IDS["F16"], 32, 256, seed=10)
    odd = _qweight(FORMAT_IDS["Q8_0"], 24, 256, seed=11)  # 24 rows: not whole panels
    m = QMatrix([q4, f16, odd]).packed()
    assert [p.packed for p in m.parts] == [True, False, False]
    assert m.parts[1] is f16 and m.parts[2] is odd
    x = torch.randn(3, 256)
    y = m(x)
    q4_alone = _mm(m.parts[0].data, FORMAT_IDS["Q4_1"], x)
    assert torch.equal(_bits(y[:, :48]), _bits(q4_alone))
    assert torch.equal(_bits(y[:, 48:]), _bits(QMatrix([f16, odd])(x)))
    with pytest.raises(ValueError, match="packed panels"):
        m.parts[0].dequantize()


def test_bad_packing_requests_are_refused_by_name():
    qw = _qweight(FORMAT_IDS["Q4_0"], 24, 64, seed=12)
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        OPS.q8pack(qw.data, qw.fmt, 64)
    with pytest.raises(RuntimeError, match="no int8 packing"):
        OPS.q8pack(qw.data, FORMAT_IDS["F16"], 64)
    packed = OPS.q8pack(qw.data[:16].contiguous(), qw.fmt, 64)
    with pytest.raises(RuntimeError, match="does not match the packed panels"):
        _mm(packed, qw.fmt, torch.randn(1, 96))


def test_packed_matrices_cost_their_gguf_size():
    for name in PACKABLE_NAMES:
        qw = _qweight(FORMAT_IDS[name], 32, 512, seed=13)
        ratio = OPS.q8pack(qw.data, qw.fmt, qw.k).numel() / qw.data.numel()
        if name == "MXFP4":  # Q4_0's record (the nibbles as indexes) with a binary16 scale: 18 bytes per 17 (q8.h)
            assert ratio == 18 / 17, ratio
            continue
        assert 1.0 <= ratio <= 1.03, (name, ratio)  # K-quants keep their 6-bit scales as bytes (q8.h)


# ---- MXFP4: exact scales only (csrc/formats.h) ----------------------------------------------------------------------

def _mxfp4(e: np.ndarray, seed: int) -> QWeight:
    """An MXFP4 matrix of random nibbles with the exponents `e` (N, K / 32)."""
    blocks = np.random.default_rng(seed).integers(0, 256, size=(*e.shape, 17), dtype=np.uint8)
    blocks[..., 0] = e
    return QWeight(torch.from_numpy(blocks.reshape(e.shape[0], -1)), FORMAT_IDS["MXFP4"], 32 * e.shape[1], "mx")


def _documented_int8_chain(qw: QWeight, x: torch.Tensor) -> torch.Tensor:
    """q8.h's chain for MXFP4 in NumPy: I_c = sum kvalue q exactly, t = float(I_c) * dx, acc = fma(a, t, acc) with
    a = 2^(e - 128) (gguf-py's e8m0_to_fp32_half), blocks in ascending order."""
    xq, dx = (t.numpy() for t in OPS.q8quantize(x))
    blocks = qw.data.numpy().reshape(qw.n, -1, 17)
    kv = np.array(gguf.quants.MXFP4.kvalues, np.int64)
    vals = np.concatenate([kv[blocks[..., 1:] & 15], kv[blocks[..., 1:] >> 4]], axis=-1)  # (N, C, 32)
    a = gguf.quants.MXFP4.e8m0_to_fp32_half(blocks[..., 0])  # (N, C) float32
    dots = np.einsum("ncj,mcj->mnc", vals, xq.astype(np.int64).reshape(x.shape[0], -1, 32))
    acc = np.zeros((x.shape[0], qw.n), np.float32)
    for c in range(dots.shape[2]):
        acc = fma32(a[None, :, c], dots[..., c].astype(np.float32) * dx[:, None, c], acc)
    return torch.from_numpy(acc)


def test_mxfp4_packs_its_exact_scales_and_gives_the_documented_chain_on_every_build():
    """The extreme exponents the panels hold (104: 2^-24, a subnormal binary16; 143: 2^15) and every one between,
    against q8.h's chain computed in NumPy from gguf-py's own decode: a scale rounded on its way into the panels, a
    wrong zero point or nibble order changes these bits."""
    e = (104 + np.arange(32 * 8) % 40).astype(np.uint8).reshape(32, 8)  # each of the 40, mixed within rows
    qw = _mxfp4(e, seed=15)
    assert qw.packs
    packed = qw.pack()
    assert packed.packed
    x = torch.randn(9, qw.k, generator=torch.Generator().manual_seed(16))
    want = _documented_int8_chain(qw, x)
    threads = torch.get_num_threads()
    try:
        for isa in BUILDS:
            for n_threads in sorted({1, threads}):
                torch.set_num_threads(n_threads)
                for rows in (1, 4, 9):
                    got = _mm(packed.data, qw.fmt, x[:rows], isa)
                    assert torch.equal(_bits(got), _bits(want[:rows])), (isa, n_threads, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("exponent", [0, 103, 144, 200])
def test_an_mxfp4_scale_no_binary16_holds_keeps_the_matrix_on_the_float32_family(exponent):
    """One block outside [104, 143] with a nonzero value: packing would round its scale, so the matrix is not
    packed (QWeight.pack, QMatrix.packed, the packed cache's plan), q8pack refuses it by name, and the float32
    family gives it the documented order on gguf-py's values, bitwise."""
    from steadyserve.models.packed_cache import packed_plan

    e = np.full((32, 4), 120, np.uint8)
    e[17, 2] = exponent
    qw = _mxfp4(e, seed=17)
    qw.data.view(32, 4, 17)[17, 2, 1] = 0x31  # a nonzero value in that block, whatever the random bytes were
    assert not qw.packs and qw.pack() is qw
    m = QMatrix([qw]).packed()
    assert not m.parts[0].packed and packed_plan(QMatrix([qw])) == [("mx", FORMAT_IDS["MXFP4"], 128, 32)]
    with pytest.raises(RuntimeError, match=f"q8pack: MXFP4 row 17, block 2 has exponent {exponent}: its scale is no "
                                           "binary16"):
        OPS.q8pack(qw.data, qw.fmt, qw.k)
    x = torch.randn(5, qw.k, generator=torch.Generator().manual_seed(18))
    want = torch.from_numpy(documented_matmul(x.numpy(), _reference_values(qw).numpy()))
    assert torch.equal(_bits(m(x)), _bits(want))


def test_mxfp4_all_zero_blocks_pack_whatever_their_exponent():
    """gguf-py (as llama.cpp) writes e = 0 for a block of zeros: such a block, or one of +-0 nibbles under any
    exponent, packs with d = +0 (formats.h), and the outputs are those of the same matrix with an exact scale there."""
    w = np.random.default_rng(19).standard_normal((32, 256)).astype(np.float32) * 0.05
    w[3, 64:96] = 0.0  # gguf-py: e = 0
    w[20, :32] = 0.0
    raw = np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)).view(np.uint8)
    qw = QWeight(torch.from_numpy(raw.reshape(32, -1).copy()), FORMAT_IDS["MXFP4"], 256, "mx")
    blocks = qw.data.view(32, 8, 17)
    assert blocks[3, 2, 0] == 0 and blocks[20, 0, 0] == 0
    blocks[7, 5, 0], blocks[7, 5, 1:] = 255, torch.tensor([0x08, 0x80, 0x88, 0x00] * 4, dtype=torch.uint8)  # -0s, 2^127
    assert qw.packs
    exact = qw.data.clone()
    exact.view(32, 8, 17)[[3, 20, 7], [2, 0, 5], 0] = 128  # the same zeros under an in-range scale
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(20))
    want = _mm(OPS.q8pack(exact, qw.fmt, 256), qw.fmt, x, 0)
    got_packed = qw.pack()
    assert got_packed.packed
    for isa in BUILDS:
        assert torch.equal(_bits(_mm(got_packed.data, qw.fmt, x, isa)), _bits(want)), isa
