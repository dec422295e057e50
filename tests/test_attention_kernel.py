"""The native paged-attention kernel: accuracy, and the bitwise claims its source documents.

The kernel must be built wherever the suite runs (make install builds it; CI
machines have a compiler): a missing kernel fails here rather than skipping.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cpu_builds import FLOAT_BUILDS, NAMES, attention_q8_build

from steadyserve import kernels
from steadyserve.models.attention import attention_invariant, attention_native, attention_plain

H, HKV, D, BS = 9, 3, 64, 32  # SmolLM2's heads: 3 query heads per kv head


@pytest.fixture(scope="module", autouse=True)
def native_built() -> None:
    st = kernels.load()
    assert st.available, f"the native kernel must build on this machine: {st.detail}"
    kernels.build.load_test_ops()  # kv_halves_to_floats, kv_floats_to_halves: test-only ops


def paged_cache(num_blocks: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, HKV, D, BS, generator=g), torch.randn(num_blocks, HKV, BS, D, generator=g)


def tables_for(lengths: list[int], num_blocks: int, seed: int = 1) -> torch.Tensor:
    """Each sequence gets its own blocks, in a scrambled order (as a long-running cache has them)."""
    need = [(n + BS - 1) // BS for n in lengths]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:sum(need)]
    rows, i = [], 0
    for k in need:
        rows.append(perm[i:i + k].tolist() + [0] * (max(need) - k))
        i += k
    return torch.tensor(rows, dtype=torch.int64)


def prefill_batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_of and positions for every token of every sequence."""
    seq_of = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    return seq_of, pos


def run(q, k, v, tables, seq_of, pos, window=0, fn=attention_native):
    return fn(q, k, v, tables, seq_of, pos, D ** -0.5, window)


@pytest.mark.parametrize("window", [0, 40])
def test_matches_float64_attention(window: int) -> None:
    k, v = paged_cache(40)
    lengths = [300, 70, 1, 33]
    tables = tables_for(lengths, 40)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), H, D, generator=torch.Generator().manual_seed(2))
    out = run(q, k, v, tables, seq_of, pos, window)
    ref = run(q.double(), k.double(), v.double(), tables, seq_of, pos, window, fn=attention_plain)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-5, f"max |native - float64 SDPA| = {err}"


@pytest.mark.parametrize("fn", [attention_native, attention_invariant], ids=["native", "python"])
@pytest.mark.parametrize("window", [24, 40])
def test_a_window_only_masks_keys_in_the_same_reduction_order(fn, window: int) -> None:
    """A sliding window (Gemma 3's local layers) changes which keys count, never the order of the sums.

    Inside the window the output is bitwise the unwindowed one. Beyond it, the windowed output equals,
    bitwise, the unwindowed output on a cache whose out-of-window keys score so low (k = -100 q) that
    their exponentials are exact zeros: a masked key adds +0 to its lane and fma(0, v, a) = a. The
    window starts mid-block and off the 16-lane grid (24), or on it (40)."""
    k, v = paged_cache(8)
    n = 70
    tables = tables_for([n], 8)
    seq_of, pos = prefill_batch([n])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(n, HKV, 1, D, generator=g).expand(n, HKV, H // HKV, D).reshape(n, H, D).contiguous()
    windowed, full = run(q, k, v, tables, seq_of, pos, window, fn), run(q, k, v, tables, seq_of, pos, 0, fn)
    assert torch.equal(windowed[:window], full[:window])
    assert not torch.equal(windowed[window:], full[window:])  # the window does bite beyond it
    for p in (window, 47, 69):
        k2 = k.clone()
        for j in range(p - window + 1):  # every key the window excludes for position p
            blk, off = int(tables[0, j // BS]), j % BS
            k2[blk, :, :, off] = -100.0 * q[p].view(HKV, H // HKV, D)[:, 0]
        one = (torch.tensor([0]), torch.tensor([p]))
        assert torch.equal(run(q[p:p + 1], k, v, tables, *one, window, fn),
                           run(q[p:p + 1], k2, v, tables, *one, 0, fn)), p
        assert torch.equal(run(q[p:p + 1], k, v, tables, *one, window, fn), windowed[p:p + 1]), p  # decode == prefill


@pytest.mark.parametrize("fn", [attention_native, attention_invariant], ids=["native", "python"])
def test_soft_capped_scores_match_float64_and_keep_prefill_equal_to_decode(fn) -> None:
    """Gemma 2's tanh(s / cap) * cap on the scaled scores; a cap of 3 bites on these scores."""
    k, v = paged_cache(40)
    lengths = [70, 33]
    tables = tables_for(lengths, 40)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), H, D, generator=torch.Generator().manual_seed(2)) * 2
    out = fn(q, k, v, tables, seq_of, pos, D ** -0.5, 24, 3.0)
    ref = attention_plain(q.double(), k.double(), v.double(), tables, seq_of, pos, D ** -0.5, 24, 3.0)
    uncapped = attention_plain(q.double(), k.double(), v.double(), tables, seq_of, pos, D ** -0.5, 24)
    assert (ref - uncapped).abs().max() > 1e-2  # the cap changes the result
    assert (out.double() - ref).abs().max() < 1e-5
    for i in (0, 50, 69, 70, 102):  # each token alone (= decode) gives its bits from the whole batch
        one = fn(q[i:i + 1], k, v, tables, seq_of[i:i + 1], pos[i:i + 1], D ** -0.5, 24, 3.0)
        assert torch.equal(one, out[i:i + 1]), i


@pytest.mark.parametrize("fn", [attention_native, attention_invariant], ids=["native", "python"])
def test_attention_sinks_match_float64_and_keep_prefill_equal_to_decode(fn) -> None:
    """gpt-oss's sinks: one logit per query head that joins the softmax with no value. Against float64 with the
    sink as an extra key; a sink of -inf is exactly no sink; each token alone gives its bits from the batch."""
    k, v = paged_cache(40)
    lengths = [70, 33]
    tables = tables_for(lengths, 40)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), H, D, generator=torch.Generator().manual_seed(2))
    sinks = torch.linspace(-3.0, 4.0, H)  # some heads send most of their weight to the sink
    out = fn(q, k, v, tables, seq_of, pos, D ** -0.5, 24, sinks=sinks)
    ref = attention_plain(q.double(), k.double(), v.double(), tables, seq_of, pos, D ** -0.5, 24, sinks=sinks)
    plain = attention_plain(q.double(), k.double(), v.double(), tables, seq_of, pos, D ** -0.5, 24)
    assert (ref - plain).abs().max() > 1e-2  # the sinks change the result
    assert (out.double() - ref).abs().max() < 1e-5
    none = fn(q, k, v, tables, seq_of, pos, D ** -0.5, 24)
    assert torch.equal(fn(q, k, v, tables, seq_of, pos, D ** -0.5, 24, sinks=torch.full((H,), float("-inf"))), none)
    for i in (0, 50, 69, 70, 102):  # each token alone (= decode) gives its bits from the whole batch
        one = fn(q[i:i + 1], k, v, tables, seq_of[i:i + 1], pos[i:i + 1], D ** -0.5, 24, sinks=sinks)
        assert torch.equal(one, out[i:i + 1]), i


def test_sinks_are_refused_unless_one_float_per_query_head() -> None:
    k, v = paged_cache(4)
    tables, (seq_of, pos) = tables_for([5], 4), prefill_batch([5])
    q = torch.randn(5, H, D)
    for bad in (torch.zeros(H - 1), torch.zeros(H, dtype=torch.float64), torch.zeros(1, H)):
        with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
            torch.ops.steadyserve.paged_attention(q, k, v, tables, seq_of, pos, torch.empty_like(q), 0.125, 0, 0.0,
                                                  bad)


def test_native_softcap_op_is_elementwise_and_close_to_tanh() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 1000, generator=g) * 50  # 1000 = 62 * 16 + 8: a tail
    y = x.clone()
    torch.ops.steadyserve.softcap_(y, 30.0)
    assert (y - torch.tanh(x / 30.0) * 30.0).abs().max() < 1e-5 * 30
    for rows in (slice(0, 1), slice(3, 8)):
        part = x[rows].clone()
        torch.ops.steadyserve.softcap_(part, 30.0)
        assert torch.equal(part, y[rows])


def test_token_alone_equals_token_in_any_batch_bitwise() -> None:
    """Prefill of everything at once vs each token alone (= decode) vs other batch mates and orders."""
    k, v = paged_cache(40)
    lengths = [300, 70, 17]
    tables = tables_for(lengths, 40)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), H, D, generator=torch.Generator().manual_seed(3))
    whole = run(q, k, v, tables, seq_of, pos)
    for t in [0, 1, 15, 16, 31, 32, 33, 100, 299, 300, 369, 386]:
        alone = run(q[t:t + 1], k, v, tables[seq_of[t:t + 1]], torch.zeros(1, dtype=torch.int64), pos[t:t + 1])
        assert torch.equal(alone[0], whole[t]), f"token {t}: alone differs from the batch"
    # A chunk of a prompt starting at an odd position (chunked prefill): the kernel pairs consecutive tokens,
    # so its pairs now straddle 16-key chunks and 32-key blocks (15|16, 31|32, ...): same bits.
    chunk = slice(15, 75)
    assert torch.equal(run(q[chunk], k, v, tables, seq_of[chunk], pos[chunk]), whole[chunk])
    # The same tokens in reverse order, with their tables in another order: same bits.
    order = torch.arange(len(pos) - 1, -1, -1)
    shuffled = run(q[order], k, v, tables.flip(0), (len(lengths) - 1 - seq_of)[order], pos[order])
    assert torch.equal(shuffled, whole[order])


def test_same_bits_on_one_and_two_threads_and_other_block_placement() -> None:
    k, v = paged_cache(40)
    lengths = [200, 64]
    tables = tables_for(lengths, 40)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), H, D, generator=torch.Generator().manual_seed(4))
    two = run(q, k, v, tables, seq_of, pos)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(q, k, v, tables, seq_of, pos)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # Move every block elsewhere in the cache: the kernel reads through the table, so bits stay.
    other = tables_for(lengths, 40, seed=9)
    k2, v2 = k.clone(), v.clone()
    k2[other[tables != 0]] = k[tables[tables != 0]]
    v2[other[tables != 0]] = v[tables[tables != 0]]
    k2[other[0, 0]], v2[other[0, 0]] = k[tables[0, 0]], v[tables[0, 0]]  # block 0 is also the padding id
    assert torch.equal(run(q, k2, v2, other, seq_of, pos), two)


def test_python_fallback_is_invariant_too_and_agrees_with_native() -> None:
    """Both paths give a token the same bits in a prefill batch or alone (decode), and they agree to float32
    rounding. Their bits are not promised equal (nor unequal): the fingerprint names the kernel."""
    k, v = paged_cache(20)
    lengths = [150]
    tables = tables_for(lengths, 20)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), H, D, generator=torch.Generator().manual_seed(5))
    py = run(q, k, v, tables, seq_of, pos, fn=attention_invariant)
    nat = run(q, k, v, tables, seq_of, pos)
    assert (py - nat).abs().max().item() < 1e-5
    for fn, batched in ((attention_invariant, py), (attention_native, nat)):
        for i in (0, 77, len(pos) - 1):
            alone = run(q[i:i + 1], k, v, tables, seq_of[i:i + 1], pos[i:i + 1], fn=fn)
            assert torch.equal(alone[0], batched[i]), (fn.__name__, i)


def caches_in(fmt: str, nb: int, hkv: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (K, V) cache pair stored in `fmt` (kv_format.h's layouts): fp32, f16, bf16, or q8_0 as random int8
    values with random f16 scales, laid out as kv_cache.py allocates them."""
    k, v = torch.randn(nb, hkv, d, BS, generator=g), torch.randn(nb, hkv, BS, d, generator=g)
    if fmt != "q8_0":
        dtype = {"fp32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[fmt]
        return k.to(dtype), v.to(dtype)
    kq = torch.randint(-127, 128, (nb, hkv, d, BS), generator=g, dtype=torch.int8)
    vq = torch.randint(-127, 128, (nb, hkv, BS, d), generator=g, dtype=torch.int8)
    ks = torch.rand(nb, hkv, d // 32, BS, generator=g).half().view(torch.int8).reshape(nb, hkv, d // 16, BS)
    vs = torch.rand(nb, hkv, BS, d // 32, generator=g).half().view(torch.int8)  # (nb, hkv, BS, d / 16)
    return torch.cat([kq, ks], 2).contiguous(), torch.cat([vq, vs], 3).contiguous()


# (query heads, kv heads, head dim, window, softcap): SmolLM2's heads; Gemma 3's (4 per kv head, 256 dims) on a
# sliding-window layer; Gemma 2's soft-capping on a head dim that takes the narrow (16-wide) passes; one query head per
# kv head (SmolLM2-1.7B's), where up to 4 tokens of a tile share each pass over a block, on a window too.
LONG_SHAPES = {"smollm2": (9, 3, 64, 0, 0.0), "gemma3_local": (4, 1, 256, 200, 0.0),
               "softcap_narrow": (2, 1, 48, 0, 30.0), "mha": (4, 4, 64, 0, 0.0), "mha_window": (2, 2, 64, 100, 0.0)}


@pytest.mark.parametrize(("fmt", "shape"), [(fmt, shape) for shape, (_, _, d, _, _) in LONG_SHAPES.items()
                                             for fmt in ("fp32", "f16", "bf16", "q8_0") if fmt != "q8_0" or d % 32 == 0])
def test_long_prefill_tiles_give_each_row_its_bits_alone(fmt: str, shape: str) -> None:
    """paged_attention.cpp runs a prefill chunk's tokens in tiles that share each K/V block (converted to floats
    once per tile): a row's bits must not depend on it. A 650-token prompt (a partly filled last block) prefilled
    in chunks of M rows, for several M (tiles of 2 to 16 tokens, many tiles per call, a chunk starting off the
    block grid), on 1 and 2 threads (the tile size follows the thread count), equals each row computed alone
    (a tile of one: the untiled loop), bitwise. q8_0 needs a head dim that is a multiple of 32 (not 48)."""
    h, hkv, d, window, softcap = LONG_SHAPES[shape]
    n = 650
    g = torch.Generator().manual_seed(7)
    nb = n // BS + 4
    k, v = caches_in(fmt, nb, hkv, d, g)
    tables = torch.randperm(nb, generator=g)[:n // BS + 1].view(1, -1)
    pos, seq_of = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    q = torch.randn(n, h, d, generator=g)

    def attend(rows: slice) -> torch.Tensor:
        return attention_native(q[rows], k, v, tables, seq_of[rows], pos[rows], d ** -0.5, window, softcap)

    alone = torch.cat([attend(slice(t, t + 1)) for t in range(n)])
    assert torch.isfinite(alone).all()
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (n, 256, 37, 9):
                chunks = [attend(slice(c, min(c + m, n))) for c in range(0, n, m)]
                assert torch.equal(torch.cat(chunks), alone), f"{threads} threads, chunks of {m}"
            assert torch.equal(attend(slice(100, 300)), alone[100:300])  # a chunk starting mid-block
    finally:
        torch.set_num_threads(saved)


# Query heads per kv head beyond SmolLM2's 3: Llama 3.1 8B's 4, Qwen2.5 7B's 7, Qwen3-30B-A3B's 8 (all at 128 dims).
GQA_GROUPS = (4, 7, 8)


@pytest.mark.parametrize("fmt", ["fp32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("group", GQA_GROUPS)
def test_grouped_heads_have_the_bits_of_each_head_with_its_own_kv_head(group: int, fmt: str) -> None:
    """Grouped-query attention reads each kv head once for the G query heads that share it (attend_one and attend_tile
    run G rows per kv head). Each query head must get the bits it gets attending alone to its kv head: the same
    queries against the cache with every kv head repeated G times (G = 1, one kv head per query head), in a prefill
    (every token of a 200- and a 45-token sequence) and a decode step (each sequence's last token)."""
    hkv, d = 2, 128
    g = torch.Generator().manual_seed(group)
    lengths = [200, 45]
    nb = sum((n + BS - 1) // BS for n in lengths) + 2
    k, v = caches_in(fmt, nb, hkv, d, g)
    k1, v1 = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # query head j reads kv head j // G
    tables = tables_for(lengths, nb)
    seq_of, pos = prefill_batch(lengths)
    q = torch.randn(len(pos), hkv * group, d, generator=g)
    decode = torch.tensor([lengths[0] - 1, sum(lengths) - 1])
    for rows in (slice(None), decode):
        grouped = attention_native(q[rows], k, v, tables, seq_of[rows], pos[rows], d ** -0.5, 0)
        per_head = attention_native(q[rows], k1, v1, tables, seq_of[rows], pos[rows], d ** -0.5, 0)
        assert torch.isfinite(grouped).all()
        assert torch.equal(grouped, per_head), ("prefill" if rows == slice(None) else "decode", group, fmt)


def test_refuses_shapes_it_does_not_support() -> None:
    k, v = torch.zeros(4, HKV, D, 24), torch.zeros(4, HKV, 24, D)  # block size 24: not a multiple of 16
    q = torch.zeros(1, H, D)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        attention_native(q, k, v, torch.zeros(1, 1, dtype=torch.int64), one, one, 1.0, 0)


def test_f16_block_conversion_gives_every_half_its_float_on_each_build() -> None:
    """An f16 cache's blocks become floats in one call per block (attention_rows.h halves_block, on each build's
    lanes: F16C's vcvtph2ps in the vector builds, half.h's bit moves in the scalar one). All 65536 halves, every
    build the CPU has (cpu_builds.py, from /proc/cpuinfo): the float each stands for (PyTorch's own conversion, bit
    for bit, NaNs quieted alike)."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    want = halves.float().view(torch.int32)
    for isa in FLOAT_BUILDS + [-1]:
        got = torch.ops.steadyserve.kv_halves_to_floats(halves, isa).view(torch.int32)
        assert torch.equal(got, want), (isa, int((got != want).sum()))


# The outputs over one random cache in each KV storage format (kv_format.h): float32, f16, bf16 and q8_0 (random
# int8 values with random f16 scales, laid out as kv_cache.py allocates them), hashed together.
VECTOR_WIDTH_CASE = r"""
import hashlib, torch
def caches():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(20, 3, 64, 32, generator=g), torch.randn(20, 3, 32, 64, generator=g)
    yield k, v
    yield k.half(), v.half()
    yield k.bfloat16(), v.bfloat16()
    kq, vq = (torch.randint(-127, 128, s, generator=g, dtype=torch.int8) for s in ((20, 3, 64, 32), (20, 3, 32, 64)))
    ks, vs = (torch.rand(s, generator=g).half().view(torch.int8) for s in ((20, 3, 2, 32), (20, 3, 32, 2)))
    yield torch.cat([kq, ks.reshape(20, 3, 4, 32)], 2), torch.cat([vq, vs], 3)
def extras():  # RoPE's and the soft-cap's outputs (their loops are compiled per build beside attention's), hashed
    g = torch.Generator().manual_seed(2)
    x, cos, sin = torch.randn(70, 9 * 64, generator=g), torch.randn(70, 64, generator=g), torch.randn(70, 64, generator=g)
    torch.ops.steadyserve.rope_(x, cos, sin, 9)
    y = torch.randn(5, 1000, generator=g) * 40
    torch.ops.steadyserve.softcap_(y, 30.0)
    return hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
def digest(attend):
    g = torch.Generator().manual_seed(1)
    tables = torch.randperm(20, generator=g)[:10].view(1, 10)
    pos = torch.arange(300); seq_of = torch.zeros(300, dtype=torch.int64)
    q = torch.randn(300, 9, 64, generator=g)
    sinks = torch.randn(9, generator=g) * 3  # gpt-oss's attention sinks, one per query head
    h = hashlib.sha256()
    for k, v in caches():
        # 3 query heads per kv head, and 1 (each kv head's first query head: the passes tokens share)
        for qh, window, sink in ((q, 0, None), (q, 40, None), (q, 40, sinks), (q[:, ::3].contiguous(), 0, None),
                                 (q[:, ::3].contiguous(), 40, None)):
            # 300 rows at once, in tiles, and every third row alone (untiled): one build's bits must agree.
            s = None if sink is None else sink[:qh.shape[1]]
            whole = attend(qh, k, v, tables, seq_of, pos, window, s)
            for t in range(0, 300, 3):
                alone = attend(qh[t:t + 1], k, v, tables, seq_of[:1], pos[t:t + 1], window, s)
                if not torch.equal(alone[0], whole[t]):
                    raise SystemExit(f"tiled row {t} != the row alone ({k.dtype}, {qh.shape[1]} heads, "
                                     f"window {window}, sinks {sink})")
            h.update(whole.numpy().tobytes())
    return h.hexdigest()
"""
VECTOR_WIDTH_SCRIPT = VECTOR_WIDTH_CASE + r"""
import sys, torch
from steadyserve.kernels import load
assert load().available
def attend(q, k, v, tables, seq_of, pos, window, sinks):
    out = torch.empty_like(q)
    torch.ops.steadyserve.paged_attention(q, k, v, tables, seq_of, pos, out, 0.125, window, 0.0, sinks)
    return out
print(torch.ops.steadyserve.qmm_isa(), torch.ops.steadyserve.attention_isa(True), digest(attend), extras())
"""


@pytest.mark.parametrize("isa", FLOAT_BUILDS, ids=[NAMES[b] for b in FLOAT_BUILDS])
def test_each_vector_width_gives_the_same_bits(isa: int) -> None:
    """attention_body.h is compiled once per build (scalar, AVX2, AVX-512) and isa.h picks one; each build the CPU has
    (from /proc/cpuinfo, cpu_builds.py), run under STEADYSERVE_ISA in its own process, gives the bits of the build
    this process runs, for every KV storage format (VECTOR_WIDTH_CASE), and within each build rows computed in tiles
    (300 at once) equal the same rows alone (the untiled loop)."""
    case: dict = {}
    exec(VECTOR_WIDTH_CASE, case)
    here = case["digest"](lambda q, k, v, tables, seq_of, pos, window, sinks:
                          attention_native(q, k, v, tables, seq_of, pos, 0.125, window, sinks=sinks))
    r = subprocess.run([sys.executable, "-c", VECTOR_WIDTH_SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "STEADYSERVE_ISA": NAMES[isa]})
    assert r.returncode == 0, r.stderr[-3000:]
    ran, ran_q8, digest, extras = r.stdout.split()
    assert int(ran) == isa, f"STEADYSERVE_ISA={NAMES[isa]} ran build {ran}"
    q8_want = attention_q8_build(isa)  # the q8_0 cache's integer scores
    assert int(ran_q8) == q8_want, f"STEADYSERVE_ISA={NAMES[isa]}: a q8_0 cache ran build {ran_q8}, not {q8_want}"
    mine = NAMES[torch.ops.steadyserve.qmm_isa()]
    assert digest == here, f"attention: the {NAMES[isa]} build differs from this process's ({mine})"
    assert extras == case["extras"](), f"RoPE or soft-cap: the {NAMES[isa]} build differs from this process's ({mine})"


def test_native_rope_equals_the_pytorch_expression_bitwise() -> None:
    """csrc/rope.cpp claims the bits of layers.apply_rope (x * cos + rotate_half(x) * sin), in place on the
    q and k heads of a fused q|k|v row, leaving v alone; with any thread count."""
    from steadyserve.models.layers import apply_rope

    g = torch.Generator().manual_seed(11)
    t, heads = 300, H + HKV
    width = (H + 2 * HKV) * D
    qkv = torch.randn(t, width, generator=g) * torch.exp(torch.empty(t, width).uniform_(-7, 7, generator=g))
    angles = torch.rand(t, D // 2, generator=g) * 4000  # positions up to thousands: any phase
    cos, sin = torch.cat([angles.cos()] * 2, dim=1), torch.cat([angles.sin()] * 2, dim=1)  # (T, D), as rope_tables
    want = apply_rope(qkv[:, :heads * D].view(t, heads, D), cos, sin)
    for threads in (1, 2):
        saved = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            got = qkv.clone()
            torch.ops.steadyserve.rope_(got, cos, sin, heads)
        finally:
            torch.set_num_threads(saved)
        assert torch.equal(got[:, :heads * D].view(t, heads, D), want)
        assert torch.equal(got[:, heads * D:], qkv[:, heads * D:])  # v untouched
    rows = qkv[100:164].clone()  # a slice of rows, as the row tiler passes them
    torch.ops.steadyserve.rope_(rows, cos[100:164].contiguous(), sin[100:164].contiguous(), heads)
    assert torch.equal(rows[:, :heads * D].view(64, heads, D), want[100:164])
