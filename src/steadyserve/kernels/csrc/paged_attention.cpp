// Causal attention over a paged KV cache, with one fixed reduction order per output row.
//
// Why: a token's attention output must be bitwise identical whether it was computed
// in prefill, chunked prefill or decode, whatever else is in the batch, on any
// thread count, and (for fleet reproducibility) on any x86-64 vector width.
//
// The reduction order, for the token at absolute position p and one query head:
//   1. score[j] = s_D * scale, where s_0 = 0 and s_{d+1} = fma(q[d], k_j[d], s_d) (one
//      rounding per step, d ascending), for every key j in [first, p], where first = 0,
//      or p - window + 1 with a sliding window. With soft-capping (Gemma 2), score[j] =
//      softcap(score[j]) = tanh(score[j] / cap) * cap, tanh from exp_det16 (softcap16).
//   2. m = max_j score[j]   (exact in any order).
//   3. e[j] = exp_det16(score[j] - m), a polynomial exp made of IEEE mul/add only.
//   4. l = sum_j e[j] over 16 lanes: lane i sums the keys with j % 16 == i in
//      ascending j; the 16 lanes are then added in one fixed pairwise tree.
//      With attention sinks (gpt-oss: one logit s per query head, a key without a value),
//      m in step 2 is max(m, s), and l = l + exp_det16(s - m), added after the tree.
//   5. out[d] = a / l, where a accumulates fma(e[j], v_j[d], a) over j ascending.
// Over a q8_0 cache, step 1 is integer (as llama.cpp's q8_0 K, whose queries it converts to q8_0 too):
//   1'. each query row is quantized per 32 dims c by kv_format.h's q8_0 rule, its scale dq_c kept as a float32 (a
//      function of that row alone); with the key's int8 values and f16 scale dk_{j,c}, I_{j,c} is their exact int32
//      dot product over the 32 dims, and score[j] = s * scale with s_0 = 0 and
//      s_{c+1} = fma(float(I_{j,c}), dq_c * dk_{j,c}, s_c), c ascending. Soft-capping and steps 2-5 as above.
// The pieces of each step (the exponential, the score chains, the softmax sums, the exact conversions of stored
// values) are in attention_rows.h; this file walks the blocks and tiles and registers the op.
// The KV cache may be stored as float32, f16, bf16 or q8_0 (kv_format.h). Each stored K or V value (but a q8_0
// key, step 1') is first turned back into the float it stands for, exactly (no rounding: see kv_format.h), and the
// steps then run on those floats: the order above is the same for every format of a kind, and a float format changes
// only the values read. An integer sum is exact in any order, so a build's instructions for it change no bit.
// Every lane of every vector computes one element with the same sequence of IEEE
// operations, so the vector width (the build: attention_body.h compiled for baseline x86-64,
// AVX2 or AVX-512, picked at run time by isa.h) changes speed, never bits. The fused multiply-adds are
// written out (fmaf: exactly rounded everywhere; the baseline build calls libm's);
// -ffp-contract=off keeps the compiler from fusing anything else, and there is no
// -ffast-math, so it may not reorder any of it.
//
// Work is split over (tile, kv-head) pairs; each pair is owned by one thread and
// all query heads of its group share the K/V loads. A tile is a run of up to kTile
// consecutive tokens of one sequence (a prefill chunk's rows): it walks the K and V
// blocks its tokens attend to once, block by block, turning a stored block into
// floats once (f16, bf16, q8_0) and letting every token of the tile use it while it
// sits in cache. Tiling changes which loop visits a (token, key) pair first, never
// the operations of a row: each token still runs steps 1-5 above on the same floats,
// its scores per key in a d-ascending fma chain, its 16 sum lanes and its V
// accumulators over keys ascending (an accumulator parked in memory between blocks
// is stored and reloaded exactly). So a row has the same bits in a tile of any size,
// alone (decode: a tile of one takes the untiled loop, attend_one) or in any batch;
// the tile size is a speed knob, not part of the numerics.

#include "fp_env.h"
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "attention.h"
#include "isa.h"
#include "kv_format.h"
#include "ops.h"

namespace {

using namespace steady_attn;  // attention.h

// The build isa.h picks for this process and a cache format (kv_format.h).
const Build& best(int fmt) { return build(steady_isa::best_attention(fmt == steady_kv::kQ8)); }

// p rounded up to a 64-byte boundary (a buffer kLanes floats longer than it needs holds it).
inline float* align_up(float* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<float*>((a + 63) & ~std::uintptr_t(63));
}

// One unit of work: tokens [t0, t1) of one sequence (a tile) and kv head g.
struct Unit {
  int64_t t0, t1;  // the tile's tokens
  int64_t g;       // the kv head
};

// The storage format of a cache tensor, from its dtype (kv_format.h); -1 for none.
int kv_fmt(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: return steady_kv::kF32;
    case at::kHalf: return steady_kv::kF16;
    case at::kBFloat16: return steady_kv::kBF16;
    case at::kChar: return steady_kv::kQ8;
    default: return -1;
  }
}

}  // namespace

namespace steady_attn {

const Build& build(int isa) {
#define STEADY_ATTN_BUILD(ns) \
  Build { ns::attend_for_shape, ns::softcap_rows, ns::rope_rows, ns::halves_to_floats, ns::floats_to_halves }
  static const Build kBuilds[3] = {STEADY_ATTN_BUILD(scalar), STEADY_ATTN_BUILD(avx2), STEADY_ATTN_BUILD(avx512)};
#undef STEADY_ATTN_BUILD
  return kBuilds[isa];
}

}  // namespace steady_attn

namespace steady_ops {  // ops.h; registered in bindings.cpp

namespace {

// Every index the call will follow, checked before any is: token t reads row seq_of[t] of the block tables, at
// positions [first_key, pos[t]], so entries first_key / bs to pos[t] / bs of that row, each a block of the cache.
void check_indices(const Problem& P, int64_t T, int64_t S, int64_t NB, const int64_t* seq_of, const int64_t* pos,
                   const int64_t* tables) {
  // Each row's entries are checked once over the span its tokens read (not once per token: a long prefill's
  // tokens share most of their blocks, and the op runs once per layer).
  std::vector<int64_t> lo(size_t(S), INT64_MAX), hi(size_t(S), -1);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(seq_of[t] >= 0 && seq_of[t] < S, "paged_attention: seq_of[", t, "] = ", seq_of[t],
                " is not a row of block_tables (", S, " rows)");
    TORCH_CHECK(pos[t] >= 0 && pos[t] / P.bs < P.nb_max, "paged_attention: positions[", t, "] = ", pos[t],
                " is outside the ", P.nb_max, " blocks of ", P.bs, " a block_tables row holds");
    const size_t s = size_t(seq_of[t]);
    lo[s] = std::min(lo[s], first_key(P, pos[t]) / P.bs);
    hi[s] = std::max(hi[s], pos[t] / P.bs);
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t* row = tables + s * P.nb_max;
    for (int64_t b = lo[size_t(s)]; b <= hi[size_t(s)]; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < NB, "paged_attention: block_tables[", s, ", ", b, "] = ", row[b],
                  " is not a block of the cache (", NB, " blocks)");
  }
}

}  // namespace

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_of, const at::Tensor& positions,
                     at::Tensor& out, double scale, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks) {
  const int fmt = kv_fmt(k_cache);
  TORCH_CHECK(q.scalar_type() == at::kFloat && fmt >= 0 && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: float32 queries; a float32, float16, bfloat16 or int8 (q8_0) K/V cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_of.scalar_type() == at::kLong &&
              positions.scalar_type() == at::kLong, "paged_attention: int64 indices");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_of.is_contiguous() && positions.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: bad ranks");
  Problem P;
  const int64_t T = q.size(0);
  P.h = q.size(1);
  P.d = q.size(2);
  P.hkv = k_cache.size(1);
  P.bs = k_cache.size(3);
  P.nb_max = block_tables.size(1);
  const int64_t stored_d = fmt == steady_kv::kQ8 ? P.d + P.d / 16 : P.d;  // q8_0 rows carry their scales
  TORCH_CHECK(fmt != steady_kv::kQ8 || P.d % steady_kv::kQBlock == 0,
              "paged_attention: a q8_0 cache needs a head dim that is a multiple of 32");
  TORCH_CHECK(k_cache.size(2) == stored_d && v_cache.size(2) == P.bs && v_cache.size(3) == stored_d &&
                  v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == P.hkv,
              "paged_attention: cache shapes do not match q");
  TORCH_CHECK(P.h % P.hkv == 0 && best(fmt).attend_for_shape(fmt, P.h / P.hkv, 16, 16).tile != nullptr,
              "paged_attention: 1 to 8 query heads per kv head");
  TORCH_CHECK(P.bs % kLanes == 0 && P.d % kLanes == 0, "paged_attention: block size and head dim must be multiples of 16");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "paged_attention: out must be a contiguous float32 tensor shaped like q");
  TORCH_CHECK(block_tables.dim() == 2 && seq_of.dim() == 1 && positions.dim() == 1 && seq_of.numel() == T &&
                  positions.numel() == T,
              "paged_attention: block_tables must be (S, NBmax), seq_of and positions (T,) for T = ", T, " queries");
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == P.h,
                "paged_attention: sinks must be a contiguous float32 (H,) tensor, one logit per query head (H = ",
                P.h, ")");
    P.sinks = sinks->data_ptr<float>();
  }
  P.window = window;
  check_indices(P, T, block_tables.size(0), k_cache.size(0), seq_of.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
                block_tables.data_ptr<int64_t>());
  P.q = q.data_ptr<float>();
  P.k = static_cast<const uint8_t*>(k_cache.data_ptr());
  P.v = static_cast<const uint8_t*>(v_cache.data_ptr());
  P.head_bytes = steady_kv::head_bytes(fmt, P.d, P.bs);
  P.tables = block_tables.data_ptr<int64_t>();
  P.seq_of = seq_of.data_ptr<int64_t>();
  P.pos = positions.data_ptr<int64_t>();
  P.out = out.data_ptr<float>();
  P.scale = static_cast<float>(scale);
  P.softcap = static_cast<float>(softcap);
  const int64_t group = P.h / P.hkv;
  const Kernels kern = best(fmt).attend_for_shape(fmt, group, P.bs, P.d);
  // Tiles: runs of consecutive tokens of one sequence, at most `tile` long. Tiles are at most kTile tokens, and
  // shorter where a call has few tokens, so there are units for every thread (a speed choice: bits do not
  // depend on it).
  const int64_t threads = at::get_num_threads();
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(kTile, T * P.hkv / (4 * threads)));
  std::vector<int64_t> starts;  // tile i is tokens [starts[i], starts[i + 1])
  for (int64_t t = 0; t < T; ++t)
    if (starts.empty() || t - starts.back() == tile || P.seq_of[t] != P.seq_of[t - 1]) starts.push_back(t);
  starts.push_back(T);
  const int64_t n_tiles = static_cast<int64_t>(starts.size()) - 1;
  // Units (tile, kv head), in the order threads take them: a run of tiles of one sequence (a prefill chunk) goes kv
  // head by kv head, so the tiles of one head follow each other and find that head's K/V blocks still in cache (a
  // 2,048-token context's are 512 KiB per head in f16; taken tile by tile, all heads' blocks passed between two uses,
  // 16 MiB on SmolLM2-1.7B). Lone tokens (decode) keep one token's heads together: those read neighbouring regions of
  // the same blocks. Which thread runs a unit, and when, never changes its bits.
  std::vector<Unit> units;
  units.reserve(static_cast<size_t>(n_tiles * P.hkv));
  for (int64_t a = 0; a < n_tiles;) {
    int64_t b = a + 1;  // tiles [a, b): one sequence's run
    while (b < n_tiles && P.seq_of[starts[b]] == P.seq_of[starts[a]]) ++b;
    for (int64_t g = 0; g < P.hkv; ++g)
      for (int64_t i = a; i < b; ++i) units.push_back({starts[i], starts[i + 1], g});
    a = b;
  }
  // Units are dealt round-robin, not in contiguous ranges: in a causal prefill later tokens attend to more keys,
  // and with contiguous halves the thread holding the first half idled for most of the call.
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int64_t n_workers = std::min<int64_t>(threads, n_units);
  steady_fp::parallel_for(0, n_workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch, acc, kvf;
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = worker; i < n_units; i += n_workers) {
        const int64_t t0 = units[i].t0, t1 = units[i].t1, g = units[i].g;
        int64_t max_pos = 0;
        for (int64_t t = t0; t < t1; ++t) max_pos = std::max(max_pos, P.pos[t]);
        const int64_t stride = max_pos + 2 * kLanes;  // room for each token's chunk-aligned span [c0, p]
        // The scores, then (q8_0) the quantized query rows, in floats.
        const int64_t q8_floats = fmt == steady_kv::kQ8 ? ((t1 - t0) * group * q8_row_bytes(P.d) + 3) / 4 : 0;
        scratch.resize(static_cast<size_t>((t1 - t0) * group * stride + q8_floats));
        if (t1 - t0 == 1 && kern.one != nullptr) {  // a lone token: the untiled loop (see one_for)
          kern.one(P, t0, g, scratch.data(), stride);
          continue;
        }
        acc.resize(static_cast<size_t>((t1 - t0) * group * P.d + kLanes));
        // The converted K and V blocks, on 64-byte boundaries: the tile's loops read them a whole vector at a
        // time, and a vector load across two cache lines (malloc aligns to 16 bytes) costs two.
        kvf.resize(static_cast<size_t>(2 * P.d * P.bs + kLanes));
        float* kf = align_up(kvf.data());
        const uint8_t* after = nullptr;  // the first K block of the unit this thread runs next
        if (const int64_t nx = i + n_workers; nx < n_units) {
          const int64_t nt = units[nx].t0, first = first_key(P, P.pos[nt]);
          after = P.k + (P.tables[P.seq_of[nt] * P.nb_max + first / P.bs] * P.hkv + units[nx].g) * P.head_bytes;
        }
        kern.tile(P, t0, t1, g, scratch.data(), stride, align_up(acc.data()), kf, kf + P.d * P.bs, after);
      }
    }
  });
}

int64_t attention_isa(bool q8_cache) { return steady_isa::best_attention(q8_cache); }

// The f16 cache's block conversion on its own (tests: every build gives every half's float): h float16, any shape;
// isa: a float32 build index (isa.h; -1: best_float()), refused where the CPU cannot run it.
at::Tensor kv_halves_to_floats(const at::Tensor& h, int64_t isa) {
  TORCH_CHECK(h.scalar_type() == at::kHalf && h.is_contiguous(), "kv_halves_to_floats: a contiguous float16 tensor");
  const int b = steady_isa::float_build(isa, "kv_halves_to_floats");
  at::Tensor out = at::empty(h.sizes(), h.options().dtype(at::kFloat));
  build(b).halves_to_floats(static_cast<const uint16_t*>(h.data_ptr()), out.data_ptr<float>(), h.numel());
  return out;
}

// x = tanh(x / cap) * cap in place (Gemma 2's final-logit soft-capping), with softcap16: the same
// bits for an element wherever it sits, so a row's bits do not depend on the rows around it.
void softcap_(at::Tensor& x, double cap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "softcap_: x must be contiguous (T, V) float32");
  TORCH_CHECK(cap > 0, "softcap_: cap must be positive");
  const int64_t T = x.size(0), V = x.size(1);
  float* xp = x.data_ptr<float>();
  steady_fp::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) best(steady_kv::kF32).softcap_rows(xp + t * V, V, static_cast<float>(cap));
  });
}

}  // namespace steady_ops
