"""The native kernels as a library no input can break: the builds the CPU has all run, tiny and subnormal values
give the same bits on every build and thread, the caller's floating-point environment changes nothing, NaN is
promised where it is and nothing more, and bad arguments are refused by name (kernels/csrc: isa.h, fp_env.h,
bindings.cpp, q8_quantize.h).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from cpu_builds import FLOAT_BUILDS, INT8_BUILDS, NAMES, float_best, int8_best
from test_qmm import _qweight

from steadyserve.kernels import load
from steadyserve.kernels.build import CSRC, load_test_ops
from steadyserve.kernels.quant import FORMAT_IDS, FORMATS, PACKABLE, PACKED

OPS = torch.ops.steadyserve
if load().available:
    load_test_ops()  # q8quantize, qlog_softmax, kv_*: the test-only ops' own library
TINY = 1e-38  # below 127 / FLT_MAX (3.7e-37): 127 / amax overflows; subnormal from 1.18e-38 down


@pytest.fixture(scope="module", autouse=True)
def native_built() -> None:
    st = load()
    assert st.available, f"the native kernels must build on this machine: {st.detail}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _mm(packed: torch.Tensor, fmt: int, x: torch.Tensor, isa: int) -> torch.Tensor:
    y = torch.full((x.shape[0], packed.shape[0]), float("nan"))
    OPS.qmatmul_(x.contiguous(), packed, PACKED + fmt, y, 0, isa)
    return y


# ---- which builds run ---------------------------------------------------------------------------------------------

def test_the_kernels_run_every_build_proc_cpuinfo_says_the_cpu_has():
    """Detection that said less than the CPU has would make every "each build equals scalar" test pass on the scalar
    build alone; cpu_builds.py reads /proc/cpuinfo and asks the OS for AMX itself."""
    assert NAMES[OPS.q8_isa()] == NAMES[int8_best()], "the int8 family runs a narrower build than the CPU has"
    assert NAMES[OPS.qmm_isa()] == NAMES[float_best()], "the float32 family runs a narrower build than the CPU has"
    assert INT8_BUILDS[-1] == OPS.q8_isa() and FLOAT_BUILDS[-1] == OPS.qmm_isa()


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_an_unknown_isa_cap_is_an_error_naming_the_allowed_values():
    code = ("import torch; from steadyserve.kernels import load; assert load().available\n"
            "try:\n    torch.ops.steadyserve.q8_isa()\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    r = _python(code, STEADYSERVE_ISA="avx9")
    assert "REFUSED" in r.stdout and "STEADYSERVE_ISA=avx9" in r.stdout, r.stdout + r.stderr
    assert "scalar, avx2, avx512 or amx" in r.stdout
    r = _python("import torch; from steadyserve.kernels import load; assert load().available\n"
                "print(torch.ops.steadyserve.q8_isa(), torch.ops.steadyserve.qmm_isa())", STEADYSERVE_ISA="avx2")
    assert r.stdout.split() == [str(min(1, int8_best())), str(min(1, float_best()))], r.stdout + r.stderr


def test_only_isa_h_picks_a_build_and_only_fp_env_h_runs_a_bare_parallel_loop():
    """One owner for the CPU's features and the cap, and every parallel chunk under the pinned environment."""
    for src in sorted(CSRC.glob("*.[ch]*")):
        text = src.read_text()
        assert "target_clones" not in text, f"{src.name}: a build is a translation unit isa.h picks, not a clone"
        if src.name != "isa.h":
            for probe in ("__builtin_cpu_supports", "__builtin_cpu_is", "__get_cpuid", "getenv", "arch_prctl"):
                assert probe not in text, f"{src.name} asks the CPU or the environment itself ({probe}): use isa.h"
        if src.name != "fp_env.h":
            assert "at::parallel_for(" not in text, f"{src.name} runs a parallel loop outside steady_fp::parallel_for"
        if src.name != "bindings.cpp":
            assert not re.search(r"TORCH_LIBRARY(_FRAGMENT)?\s*\(", text), f"{src.name} registers ops: bindings.cpp"


def _lane_names(header: Path) -> set[str]:
    """The operations and types a lanes header defines (inline functions, types, constants)."""
    text = header.read_text()
    names = set(re.findall(r"^inline\s+(?:[\w:]+\s+)+?(\w+)\s*\(", text, re.M))
    names |= set(re.findall(r"^(?:using|struct)\s+(\w+)", text, re.M))
    names |= set(re.findall(r"^constexpr\s+\w+\s+(\w+)", text, re.M))
    return names


def test_every_build_is_one_lanes_header_and_one_pragma():
    """One lane layer: each build's translation unit includes the lanes header of its instruction set and no other,
    the instruction set is chosen by that file's pragma alone (no function-level target attribute, no GCC vector
    types beside the lanes), and the three lanes headers define the same operations (the vector ones also the same
    int8 products), so a kernel body written over one compiles on every build."""
    builds = {"scalar": [], "avx2": [], "avx512": [], "amx": []}
    for src in sorted(CSRC.glob("*.[ch]*")):
        text = src.read_text()
        assert "__attribute__((target" not in text, f"{src.name}: an instruction set per function; use a build file"
        assert "vector_size" not in text, f"{src.name}: a vector type of its own; use the lanes (lanes_scalar.h)"
        included = re.findall(r'#include "(lanes_\w+)\.h"', text)
        if src.suffix == ".cpp":
            build = src.stem.rsplit("_", 1)[-1]
            if build in builds:
                want = "lanes_avx512" if build == "amx" else f"lanes_{build}"
                assert included == [want], f"{src.name} includes {included}, not [{want}]"
                builds[build].append(src.name)
            else:
                assert not included and "#pragma GCC target" not in text, f"{src.name}: not a build file"
    assert all(builds.values()), builds
    scalar, avx2, avx512 = (_lane_names(CSRC / f"lanes_{b}.h") for b in ("scalar", "avx2", "avx512"))
    int8_products = {"W", "S", "wload", "wand", "wsrl16", "wsll16", "wor", "wlut16", "szero", "sdot", "sdot_signed", "widen",
                     "kSumRun", "kSignedBias"}
    assert int8_products <= avx2 and int8_products <= avx512, (int8_products - avx2, int8_products - avx512)
    common = {n for n in scalar}
    assert common - {"STEADY_LANES"} <= avx2 and common - {"STEADY_LANES"} <= avx512, (common - avx2, common - avx512)
    private = {"sign_bits", "load8", "load16", "bytes", "add16_in_order", "add16"}  # lanes_avx2.h's own helpers
    # The scalar lanes' only int8 product: the signed one the q8_0 cache's attention scores use (attention_rows.h)
    signed_product = {"W", "S", "wload", "szero", "sdot_signed", "widen", "kSumRun", "kSignedBias"}
    assert signed_product <= scalar, signed_product - scalar
    assert avx2 - private - int8_products == avx512 - int8_products == scalar - signed_product, \
        (avx2 ^ avx512, avx512 ^ scalar)


def test_the_python_format_table_is_the_kernels_own():
    """kernels/quant.py names the formats before any kernel is loaded (a model's tensors are checked against it);
    the kernels' traits records (formats.h) own those facts, and this holds the copy to them."""
    flat = OPS.formats()
    records = {flat[i]: (flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)}
    assert {f: (blk, nb) for f, (blk, nb, _) in records.items()} == {f: (blk, nb) for f, (_, blk, nb) in FORMATS.items()}
    assert PACKABLE == {f for f, (_, _, bits) in records.items() if bits}


# ---- tiny blocks --------------------------------------------------------------------------------------------------

def _tiny_rows() -> torch.Tensor:
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    x[0] = 0.0
    x[0, 0], x[0, 7], x[0, 200] = TINY, -TINY / 3, TINY  # the row: [1e-38, 0, ...], a negative subnormal
    x[1] *= 1e-39  # every value subnormal: the row's outputs come from tiny blocks alone
    x[2, 64:96] = torch.tensor([1.4e-45] * 16 + [-1.4e-45] * 16)  # the smallest subnormal
    x[3, :32] *= 1e-30  # amax in [3.7e-37, 2^-64): the old formula was finite here and must keep its bits
    x[4, 96:128] *= 2.0 ** -70
    return x


def _reference_tiny(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8_quantize.h's rule in torch's float32 operations: blocks with amax < 2^-64 scaled by 2^64 first."""
    m, k = x.shape
    b = x.view(m, k // 32, 32)
    amax = b.abs().amax(-1)
    tiny = (amax > 0) & (amax < 2.0 ** -64)
    up = torch.where(tiny[..., None], b * 2.0 ** 64, b)
    amax_up = torch.where(tiny, amax * 2.0 ** 64, amax)
    s = torch.where(amax > 0, 127.0 / amax_up, torch.zeros_like(amax))
    return torch.round(up * s[..., None]).to(torch.int8).view(m, k), amax / 127.0


@pytest.mark.parametrize("isa", INT8_BUILDS, ids=[NAMES[b] for b in INT8_BUILDS])
def test_tiny_activation_blocks_quantize_by_the_rule_on_every_build(isa):
    x = _tiny_rows()
    want_q, want_d = _reference_tiny(x)
    xq, dx = OPS.q8quantize(x, isa)
    assert torch.equal(xq, want_q), (xq - want_q).abs().nonzero()[:5]
    assert torch.equal(_bits(dx), _bits(want_d))
    assert int(xq.abs().max()) <= 127  # never -128: the Q8_0 sign trick's bound
    assert xq[0, 0] == 127 and xq[0, 7] == -42 and (xq[1] != 0).any() and xq[2, 64] == 127
    # Where the old formula was finite, the scaled one gives its bits.
    old_q = torch.round(x[3, :32] * (127.0 / x[3, :32].abs().max()))
    assert torch.equal(xq[3, :32], old_q.to(torch.int8))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q4_1", "MXFP4"])
def test_tiny_activation_blocks_give_every_build_and_thread_count_the_scalar_bits(name):
    fmt = FORMAT_IDS[name]
    qw = _qweight(fmt, 32, 256, seed=1)
    if name == "MXFP4":  # scales near 1: under 2^-24 a tiny row's products would round to 0 before reaching y
        qw.data.view(32, 8, 17)[..., 0] = 127 + torch.arange(32 * 8).view(32, 8) % 4
    packed = OPS.q8pack(qw.data, fmt, qw.k)
    x = _tiny_rows()
    want = _mm(packed, fmt, x, 0)
    assert (want[0] != 0).all() and (want[1] != 0).all(), "the tiny rows must reach their outputs"
    threads = torch.get_num_threads()
    try:
        for isa in INT8_BUILDS:
            for n in sorted({1, 2, threads}):
                torch.set_num_threads(n)
                assert torch.equal(_bits(_mm(packed, fmt, x, isa)), _bits(want)), (NAMES[isa], n)
    finally:
        torch.set_num_threads(threads)


def test_a_q8_0_kv_block_of_tiny_values_stores_zeros():
    """1 / d overflows there, and the conversion of inf was undefined: the block is zero as an f16 scale anyway."""
    hkv, d, bs = 1, 32, 16
    k_cache = torch.full((1, hkv, d + d // 16, bs), 99, dtype=torch.int8)
    v_cache = torch.full((1, hkv, bs, d + d // 16), 99, dtype=torch.int8)
    x = torch.zeros(1, hkv, d)
    x[0, 0, :4] = torch.tensor([TINY, -TINY, 1e-40, 3e-39])
    zero = torch.zeros(1, dtype=torch.int64)
    OPS.kv_write(k_cache, v_cache, x, x, zero, zero)
    k_values = k_cache[0, 0, :d].contiguous().view(d // 4, bs, 4)  # quads of dims, key-major (kv_format.h)
    k_scales = k_cache[0, 0, d:].contiguous().view(torch.int16).view(d // 32, bs)  # (D/32, Bs) f16 after the values
    assert not k_values[:, 0].any() and not k_scales[:, 0].any()
    assert not v_cache[0, 0, 0].any()  # this token's D values, then its D/32 scales
    assert (k_values[:, 1] == 99).all()  # the write touched this token's slots only


# ---- the floating-point environment ---------------------------------------------------------------------------------

@contextmanager
def flush_denormals_here() -> Iterator[None]:
    """FTZ and DAZ on the calling thread only, as a library built with -ffast-math would leave them."""
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals (needs SSE3)"
    try:
        assert float(torch.tensor([TINY]) * 0.5) == 0.0, "FTZ/DAZ did not take effect on this thread"
        yield
    finally:
        torch.set_flush_denormal(False)


def _subnormal_cases() -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    qw = _qweight(FORMAT_IDS["Q4_K"], 64, 256, seed=3)
    packed = OPS.q8pack(qw.data, FORMAT_IDS["Q4_K"], 256)
    fw = _qweight(FORMAT_IDS["Q8_0"], 64, 256, seed=4)
    x = torch.randn(40, 256, generator=g) * 1e-39  # subnormal activations, most rows
    x[::3] = torch.randn(14, 256, generator=g)
    rows = torch.randn(40, 64, generator=g) * 1e-39
    ones = torch.ones(64)
    q, hkv, d, bs = torch.randn(40, 3, 64, generator=g), 1, 64, 16
    k_cache = torch.randn(4, hkv, d, bs, generator=g) * 1e-39
    v_cache = torch.randn(4, hkv, bs, d, generator=g) * 1e-39
    tables = torch.tensor([[0, 1, 2, 3]])
    seq_of, pos = torch.zeros(40, dtype=torch.int64), torch.arange(40)

    def int8_matmul() -> torch.Tensor:
        return _mm(packed, FORMAT_IDS["Q4_K"], x, -1)

    def float_matmul() -> torch.Tensor:
        y = torch.empty(40, 64)
        OPS.qmatmul_(x, fw.data, fw.fmt, y, 0, -1)
        return y

    def rms_norm() -> torch.Tensor:
        return OPS.qrms_norm(rows, ones, 1e-30, -1)  # normal eps: outputs x / 1e-15, normal, or 0 if x flushed

    def attention() -> torch.Tensor:
        out = torch.empty_like(q)
        OPS.paged_attention(q, k_cache, v_cache, tables, seq_of, pos, out, 0.125, 0)
        return out  # subnormal outputs: compared as bits, never through a float operation on this thread

    # (The KV write is pinned too, but no input shows it: its f16 and q8_0 roundings of a subnormal float are 0.)
    return {f.__name__: f for f in (int8_matmul, float_matmul, rms_norm, attention)}


@pytest.mark.parametrize("case", sorted(_subnormal_cases()))
def test_ftz_and_daz_on_the_calling_thread_change_no_bit(case):
    """at::parallel_for runs chunk 0 on the caller, whose MXCSR may flush subnormals while the workers' do not; each
    op and each chunk pins MXCSR (fp_env.h), so the bits are those of the default environment on 1 and N threads."""
    fn = _subnormal_cases()[case]
    threads = torch.get_num_threads()
    try:
        want = fn()
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            with flush_denormals_here():
                got = fn()
            assert torch.equal(_bits(got), _bits(want)), (case, n)
    finally:
        torch.set_num_threads(threads)


# ---- NaN: where, not which --------------------------------------------------------------------------------------

def test_nan_outputs_are_the_same_positions_on_every_build_and_thread_count():
    """The contract (docs/design.md): which outputs are NaN is promised; a NaN's sign and payload are not (they
    depend on which operand an FMA form propagates). Every non-NaN output keeps its bits."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(24, 256, generator=g)
    x[2, 5], x[5, 100], x[9, 40] = float("nan"), float("inf"), float("-inf")
    checks = []
    q8 = _qweight(FORMAT_IDS["Q6_K"], 32, 256, seed=5)
    packed = OPS.q8pack(q8.data, q8.fmt, 256)
    for isa in INT8_BUILDS:
        checks.append(("int8", isa, _mm(packed, q8.fmt, x, isa)))
    fw = _qweight(FORMAT_IDS["Q4_0"], 32, 256, seed=6)
    for isa in FLOAT_BUILDS:
        y = torch.empty(24, 32)
        OPS.qmatmul_(x, fw.data, fw.fmt, y, 0, isa)
        checks.append(("float", isa, y))
        checks.append(("log_softmax", isa, OPS.qlog_softmax(x, isa)))
    for family in ("int8", "float", "log_softmax"):
        runs = [y for f, _, y in checks if f == family]
        nan = torch.isnan(runs[0])
        assert nan[2].any() and not nan[0].any(), family
        for y in runs[1:]:
            assert torch.equal(torch.isnan(y), nan), family
            assert torch.equal(_bits(y[~nan]), _bits(runs[0][~nan])), family


# ---- refusals -----------------------------------------------------------------------------------------------------

def test_packing_refuses_a_row_width_that_does_not_match_the_format():
    qw = _qweight(FORMAT_IDS["Q4_K"], 32, 512, seed=1)
    assert qw.data.shape[1] == 288  # two super-blocks of 144 bytes
    with pytest.raises(RuntimeError, match="q8pack: w has 144 bytes per row, GGML type 12 stores K = 512 in 288"):
        OPS.q8pack(qw.data[:, :144].contiguous(), qw.fmt, 512)
    with pytest.raises(RuntimeError, match="q8pack: K = 0"):
        OPS.q8pack(qw.data[:, :0].contiguous(), qw.fmt, 0)


def test_a_packed_matmul_refuses_k_zero():
    packed = torch.zeros(16, 0, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="qmatmul_: K = 0"):
        OPS.qmatmul_(torch.zeros(4, 0), packed, PACKED + FORMAT_IDS["Q8_0"], torch.zeros(4, 16), 0, -1)


def test_an_isa_argument_outside_the_family_is_refused_by_name():
    x = torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"kv_floats_to_halves: isa must be -1 \(auto\) or a build from 0"):
        OPS.kv_floats_to_halves(x, 3)  # the float32 family has no AMX build
    with pytest.raises(RuntimeError, match=r"int8 op: isa must be -1 \(auto\) or a build from 0 \(scalar\) to 3"):
        OPS.q8quantize(torch.zeros(1, 32), 4)


def test_attention_refuses_indices_outside_its_tables_and_cache():
    hkv, d, bs = 1, 64, 16
    k, v = torch.zeros(2, hkv, d, bs), torch.zeros(2, hkv, bs, d)
    q, out = torch.zeros(3, 3, d), torch.zeros(3, 3, d)
    ok_tables, seq_of, pos = torch.tensor([[0, 1]]), torch.zeros(3, dtype=torch.int64), torch.arange(3)
    OPS.paged_attention(q, k, v, ok_tables, seq_of, pos, out, 0.125, 0)  # the valid call runs
    bad = {
        "seq_of\\[1\\] = 5 is not a row of block_tables": (ok_tables, torch.tensor([0, 5, 0]), pos),
        "seq_of\\[0\\] = -1": (ok_tables, torch.tensor([-1, 0, 0]), pos),
        "positions\\[2\\] = 40 is outside": (ok_tables, seq_of, torch.tensor([0, 1, 40])),
        "positions\\[0\\] = -3": (ok_tables, seq_of, torch.tensor([-3, 1, 2])),
        "block_tables\\[0, 0\\] = 7 is not a block of the cache": (torch.tensor([[7, 1]]), seq_of, pos),
        "block_tables\\[0, 0\\] = -1": (torch.tensor([[-1, 1]]), seq_of, pos),
        "seq_of and positions \\(T,\\)": (ok_tables, seq_of[:2], pos),
    }
    for message, (tables, s, p) in bad.items():
        with pytest.raises(RuntimeError, match=message):
            OPS.paged_attention(q, k, v, tables, s, p, out, 0.125, 0)


def test_every_registered_op_is_declared_in_ops_h():
    """One registration file, and every op it registers is a function ops.h declares (so forward.cpp composes the
    same functions Python calls)."""
    bindings = (CSRC / "bindings.cpp").read_text()
    ops_h = (CSRC / "ops.h").read_text()
    registered = re.findall(r'STEADY_IMPL\("(\w+)", (\w+)\)', bindings)
    queries = ("qmm_isa", "q8_isa", "attention_isa", "qmm_register_rows", "formats")  # no tensors, so defined with their function
    assert len(registered) == len(re.findall(r'm\.def\("\w+\(', bindings)) - len(queries) >= 12
    test_only = re.findall(r'STEADY_IMPL\("(\w+)", (\w+)\)', (CSRC / "testing" / "test_ops.cpp").read_text())
    assert {n for n, _ in test_only} == {"q8quantize", "qlog_softmax", "kv_halves_to_floats", "kv_floats_to_halves"}
    for name, fn in registered + test_only:
        assert name == fn and re.search(rf"\b{fn}\(", ops_h), (name, fn)
        assert hasattr(OPS, name), name
    assert Path(CSRC / "fp_env.h").exists()
