// The AMX build of the int8 family: the integer sums of 16 activation rows against one 16-row panel come from
// AMX tiles, one TDPBSUD (TDPBSSD for Q8_0's signed weights) per block of 32 values: 16 x 16 x 32 products in
// one instruction. Rows left over (M mod 16), and calls of fewer than 16 rows, run the AVX-512 VNNI build.
// Called only where isa.h reports AMX-TILE and AMX-INT8 beside AVX-512 VNNI and the OS granted the tile state
// (q8linear.cpp).
//
// THE REDUCTION ORDER is q8.h's, unchanged: a tile yields each I_c exactly (an integer sum; how the tile forms
// it cannot change it), and the float chain over the blocks c in ascending order runs in the AVX-512 lanes,
// one lane per panel row, the same IEEE operations as every other build. So the bits equal the scalar build's.
//
// Per panel: its blocks are unpacked once into tile rows (q8_unpack.h: operand j is B's row j, 16 columns of 4
// bytes) with each block's a and b beside them, then each group of 16 activation rows walks the blocks two tiles
// at a time (two accumulators, so the epilogue of one overlaps the next product), keeping its 16 x 16 float
// accumulators in registers. A call with one group of rows unpacks each block just ahead of its product instead
// (panel_one_group). Where a call's rows overflow L1 and 32 of them would not, and its weights stream from memory
// (an LM head), the rows run as passes of 32 over the thread's panels (kPassRows).
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "half.h"
#include "q8.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni,amx-tile,amx-int8")

namespace steady_q8 {
namespace amx {
namespace {

#include "lanes_avx512.h"
#include "q8_unpack.h"

constexpr int kRows = 16;  // activation rows per tile: AMX's 16 tile rows
// Below 16 rows the VNNI build runs: a tile of fewer rows would still cost a whole product and store. A call of
// 16-31 rows has one group of rows, which reuses no unpacked block, so it takes panel_one_group; from 32 rows the
// panel's blocks are unpacked once and every group reuses them (panel). (Measurements: benchmarks/RESULTS.md,
// "Kernel tuning measurements".)
constexpr int64_t kMinRows = 16;

// Tiles, set once per call. Two halves (0-2 and 3-5), each an A (activations), a B (weights) and a C (int32):
// two consecutive blocks (A 16 x 32 bytes, B 8 rows of 64), or for Q6_K one block's two sub-scaled halves
// (A 16 x 16 bytes, B 4 rows of 64).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int k_bytes) {
  TileConfig c;
  for (int h = 0; h < 2; ++h) {
    c.rows[3 * h] = kRows, c.colsb[3 * h] = uint16_t(k_bytes);           // A
    c.rows[3 * h + 1] = uint8_t(k_bytes / 4), c.colsb[3 * h + 1] = 64;  // B: 4 values of 16 panel rows per row
    c.rows[3 * h + 2] = kRows, c.colsb[3 * h + 2] = 64;                 // C: 16 int32 per row
  }
  // The config is an "m" operand of the asm: GCC 12 drops the stores to a config passed to _tile_loadconfig as
  // dead (it cannot see the instruction read them), and tiles configured from garbage fault.
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// What a panel's block needs beyond its tile rows, in lanes: a and b of q8.h, Q6_K's two sub-scales.
struct BlockScales {
  float a[16], b[16];
  int32_t sc_lo[16], sc_hi[16];
};

template <int ZERO, bool MIN, bool SUB>
inline void epilogue(const Q8Args& a, const BlockScales& s, const int32_t* c0, const int32_t* c1, int64_t m0,
                     int64_t c, F (&acc)[kRows]) {
  const int64_t blocks = a.K / kBlock;
  const F wa = fload(s.a), wb = fload(s.b);
  const F fsc_lo = i2f(iload(s.sc_lo)), fsc_hi = i2f(iload(s.sc_hi));
#pragma GCC unroll 16  // whole, so that acc stays in 16 registers
  for (int m = 0; m < kRows; ++m) {
    const int64_t at = (m0 + m) * blocks + c;
    I v = iload(c0 + 16 * m);
    F fdot;  // float(I_c)
    if constexpr (SUB) {  // Q6_K: fma(sc_lo, lo + zx16_lo, sc_hi (hi + zx16_hi)), exact as in q8_body.h
      static_assert(ZERO == 32, "q8.h's zx16 holds -32 x the sums");
      fdot = ffma(fsc_lo, i2f(iadd(v, iset1(a.zx16[2 * at]))),
                  fmul(fsc_hi, i2f(iadd(iload(c1 + 16 * m), iset1(a.zx16[2 * at + 1])))));
    } else if constexpr (ZERO != 0) {
      fdot = i2f(isub(v, iset1(ZERO * a.sx[at])));
    } else {
      fdot = i2f(v);
    }
    acc[m] = ffma(wa, fmul(fdot, fset1(a.dx[at])), acc[m]);  // t = float(I) * dx; acc = fma(a, t, acc)
    if constexpr (MIN) acc[m] = ffma(wb, fset1(a.sxd[at]), acc[m]);  // acc = fma(b, sxd, acc)
  }
}

// tileloadd with a "memory" clobber. GCC 12's _tile_loadd is an asm with the address as a register and no memory
// operand or clobber, so nothing tells the compiler the instruction reads the B buffer unpack_block has just
// written: it may keep those stores in registers or sink them past the load (the class of bug the config's "m"
// operand above works around). The clobber orders every memory access around the load. (_tile_stored has one.)
#define STEADY_TILE_LOADD(T, BASE, STRIDE)                                                         \
  asm volatile("{tileloadd\t(%0,%1,1), %%tmm" #T "|tileloadd\t%%tmm" #T ", [%0+%1*1]}"           \
               :                                                                                  \
               : "r"(static_cast<const void*>(BASE)), "r"(static_cast<long>(STRIDE))             \
               : "memory")

// The products of one half: C = A (activations at x, row stride K) . B (tile rows at w), in tiles A, B, C. GCC's
// tile intrinsics paste their tile numbers into the instruction text, so each half is spelled out by this macro.
#define STEADY_AMX_PRODUCT(NAME, A, B, C)                                              \
  template <bool SIGNED>                                                               \
  inline void NAME(const int8_t* x, int64_t stride, const uint8_t* w) {                \
    STEADY_TILE_LOADD(A, x, stride);                                                   \
    STEADY_TILE_LOADD(B, w, 64);                                                       \
    _tile_zero(C);                                                                     \
    if constexpr (SIGNED) {                                                            \
      _tile_dpbssd(C, A, B);                                                           \
    } else {                                                                           \
      _tile_dpbsud(C, A, B); /* A signed (activations), B unsigned (stored integers) */ \
    }                                                                                  \
  }
STEADY_AMX_PRODUCT(product0, 0, 1, 2)
STEADY_AMX_PRODUCT(product1, 3, 4, 5)
#undef STEADY_AMX_PRODUCT

// The next panel's records: `lines` lines at `rec`, none after the thread's last panel.
struct NextPanel {
  const uint8_t* rec;
  int64_t lines;
};

inline NextPanel next_panel(const Q8Args& a, int64_t p, int64_t records) {
  return {a.w + (p + 1) * records * a.lay.record, p + 1 < a.p_end ? records * a.lay.record / 64 : 0};
}

// The next panel's records, requested into L2 while a group of rows runs: the share of blocks [b0, b1) of `blocks`.
// The VNNI build requests its stream ahead as it unpacks (q8_unpack.h's prefetch_ahead); here the unpack is a short
// loop of loads and stores before many products, and its hints, issued there in a burst of about ten a block, filled
// the line-fill buffers and stalled it. So the hints are spread over the products instead. A hint never changes a
// value.
inline void prefetch_share(const NextPanel& next, int64_t b0, int64_t b1, int64_t blocks) {
  for (int64_t l = next.lines * b0 / blocks; l < next.lines * b1 / blocks; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(next.rec + 64 * l), _MM_HINT_T1);
}

// Block c of panel p (record `rec`, block i of its `per`) as a B tile at `tile` (512 bytes) and its scales.
template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ>
inline void unpack_block(const uint8_t* rec, int i, uint8_t* tile, BlockScales& s) {
  constexpr int per = KQ ? 8 : 1;
  constexpr int qbytes = steady_fmt::qbytes(BITS);
  const uint8_t* sc = rec + per * qbytes;
  const F d = h2f(sc);
  const F d2 = MIN ? h2f(sc + steady_fmt::kScaleM) : fzero();
  W w[8];
  unpack<BITS, ZERO>(rec + i * qbytes, w);
  for (int j = 0; j < 8; ++j) _mm512_storeu_si512(tile + 64 * j, w[j]);
  F wa = d, wb = d2;
  if constexpr (KQ && MIN) {  // a = d * sc, b = -(dmin * mn), as the VNNI build
    wa = fmul(d, i2f(iload_u8(sc + steady_fmt::kScaleSc + 16 * i)));
    wb = fneg(fmul(d2, i2f(iload_u8(sc + steady_fmt::kScaleMn + 16 * i))));
  }
  fstore(s.a, wa);
  fstore(s.b, wb);
  istore(s.sc_lo, SUB ? iload_i8(sc + steady_fmt::kScaleSub + 32 * i) : izero());
  istore(s.sc_hi, SUB ? iload_i8(sc + steady_fmt::kScaleSub + 16 + 32 * i) : izero());
}

// One group of 16 rows (M = 16..31): nothing is reused across groups, so each block is unpacked two blocks ahead of
// its product into a ring of 4 (2 KiB) instead of the whole panel first (32 KiB at K = 2048, most of L1).
template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ>
void panel_one_group(const Q8Args& a, int64_t p, uint8_t* ring, BlockScales* scales) {
  const int64_t blocks = a.K / kBlock;
  constexpr int per = KQ ? 8 : 1;
  constexpr bool SIGNED = BITS == 8;
  const uint8_t* rec0 = a.w + p * (blocks / per) * a.lay.record;
  auto unpack_at = [&](int64_t c) {
    unpack_block<BITS, ZERO, MIN, SUB, KQ>(rec0 + (c / per) * a.lay.record, int(c % per), ring + 512 * (c & 3),
                                     scales[c & 3]);
  };
  const NextPanel next = next_panel(a, p, blocks / per);
  alignas(64) int32_t c[2][2][kRows * 16];  // [block parity][half (Q6_K)]
  F acc[kRows];
  for (int m = 0; m < kRows; ++m) acc[m] = fzero();
  unpack_at(0);
  if (blocks > 1) unpack_at(1);
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_share(next, b, b + 1, blocks);
    const uint8_t* tile = ring + 512 * (b & 3);
    if constexpr (SUB) {  // Q6_K: the block's two sub-scaled halves in the two tile sets
      product0<false>(a.xq + b * kBlock, a.K, tile);
      product1<false>(a.xq + b * kBlock + 16, a.K, tile + 256);
    } else if (b & 1) {  // blocks alternate between the two tile sets
      product1<SIGNED>(a.xq + b * kBlock, a.K, tile);
    } else {
      product0<SIGNED>(a.xq + b * kBlock, a.K, tile);
    }
    if (b + 2 < blocks) unpack_at(b + 2);
    const int32_t(&prev)[2][kRows * 16] = c[(b - 1) & 1];
    if (b > 0) epilogue<ZERO, MIN, SUB>(a, scales[(b - 1) & 3], prev[0], prev[1], 0, b - 1, acc);
    if (SUB) {
      _tile_stored(2, c[b & 1][0], 64);
      _tile_stored(5, c[b & 1][1], 64);
    } else if (b & 1) {
      _tile_stored(5, c[1][0], 64);
    } else {
      _tile_stored(2, c[0][0], 64);
    }
  }
  const int32_t(&last)[2][kRows * 16] = c[(blocks - 1) & 1];
  epilogue<ZERO, MIN, SUB>(a, scales[(blocks - 1) & 3], last[0], last[1], 0, blocks - 1, acc);
  for (int m = 0; m < kRows; ++m) fstore(a.y + m * a.y_stride + p * kPanel, acc[m]);
}

// Rows [r, M) of a call as a call of their own.
Q8Args rows_from(const Q8Args& a, int64_t r) {
  const int64_t blocks = a.K / kBlock;
  Q8Args rest = a;
  rest.xq += r * a.K;
  rest.dx += r * blocks;
  rest.sxd += r * blocks;
  rest.sx += r * blocks;
  rest.zx16 += r * 2 * blocks;
  rest.y += r * a.y_stride;
  rest.M = a.M - r;
  return rest;
}

template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ>
void panel(const Q8Args& a, int64_t p, int64_t rows, uint8_t* tiles, BlockScales* scales) {
  const int64_t blocks = a.K / kBlock;
  constexpr int per = KQ ? 8 : 1;
  constexpr bool SIGNED = BITS == 8;
  // The panel's blocks as tile rows (512 bytes each) and scales, once for every group of rows.
  const uint8_t* rec = a.w + p * (blocks / per) * a.lay.record;
  for (int64_t c0 = 0; c0 < blocks; c0 += per, rec += a.lay.record)
    for (int i = 0; i < per; ++i) unpack_block<BITS, ZERO, MIN, SUB, KQ>(rec, i, tiles + 512 * (c0 + i), scales[c0 + i]);
  // Each block's products are stored one step before its epilogue reads them, and a tile's store is issued after
  // the previous block's epilogue, not before: the store waits for its product, and an epilogue issued behind that
  // waiting store did not start until it was done. Issued first, the epilogue of block b - 1 runs while block b's
  // product is formed. The epilogues still run in ascending block order.
  alignas(64) int32_t c[2][2][kRows * 16];
  // The next panel's records, over the first group of rows' blocks (prefetch_share).
  const NextPanel next = next_panel(a, p, blocks / per);
  for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
    F acc[kRows];
    for (int m = 0; m < kRows; ++m) acc[m] = fzero();
    const int8_t* x = a.xq + m0 * a.K;
    if constexpr (SUB) {  // one block per step: its two halves in the two tile sets
      for (int64_t b = 0; b < blocks; ++b) {
        if (m0 == 0) prefetch_share(next, b, b + 1, blocks);
        int32_t(&out)[2][kRows * 16] = c[b & 1];
        product0<false>(x + b * kBlock, a.K, tiles + 512 * b);
        product1<false>(x + b * kBlock + 16, a.K, tiles + 512 * b + 256);
        if (b > 0) epilogue<ZERO, MIN, SUB>(a, scales[b - 1], c[~b & 1][0], c[~b & 1][1], m0, b - 1, acc);
        _tile_stored(2, out[0], 64);
        _tile_stored(5, out[1], 64);
      }
      epilogue<ZERO, MIN, SUB>(a, scales[blocks - 1], c[~blocks & 1][0], c[~blocks & 1][1], m0, blocks - 1, acc);
    } else {  // blocks alternate between the two tile sets; the chain still takes them in ascending order
      int64_t b = 0;
      for (; b + 2 <= blocks; b += 2) {
        if (m0 == 0) prefetch_share(next, b, b + 2, blocks);
        product0<SIGNED>(x + b * kBlock, a.K, tiles + 512 * b);
        if (b > 0) epilogue<ZERO, MIN, SUB>(a, scales[b - 1], c[1][0], nullptr, m0, b - 1, acc);
        _tile_stored(2, c[0][0], 64);
        product1<SIGNED>(x + (b + 1) * kBlock, a.K, tiles + 512 * (b + 1));
        epilogue<ZERO, MIN, SUB>(a, scales[b], c[0][0], nullptr, m0, b, acc);
        _tile_stored(5, c[1][0], 64);
      }
      if (b < blocks) {  // an odd count: the last block in the first set
        product0<SIGNED>(x + b * kBlock, a.K, tiles + 512 * b);
        if (b > 0) epilogue<ZERO, MIN, SUB>(a, scales[b - 1], c[1][0], nullptr, m0, b - 1, acc);
        _tile_stored(2, c[0][0], 64);
        epilogue<ZERO, MIN, SUB>(a, scales[b], c[0][0], nullptr, m0, b, acc);
      } else {
        epilogue<ZERO, MIN, SUB>(a, scales[b - 1], c[1][0], nullptr, m0, b - 1, acc);
      }
    }
    for (int m = 0; m < kRows; ++m) fstore(a.y + (m0 + m) * a.y_stride + p * kPanel, acc[m]);
  }
}

// Rows per pass over a thread's panels, where a pass's activations and one unpacked panel fit in L1 (kPassL1 bytes)
// but all rows' do not, and the thread reads more than kPassBytes of weights (an LM head streaming from memory): in
// one pass each panel walks all groups of rows, and their activations with the unpacked panel overflow L1, which
// costs more than reading and unpacking the weights again per pass. Matrices read from cache gain nothing, and
// where a pass does not fit L1 either (large K) passes cost more; hence both bounds.
constexpr int64_t kPassRows = 32;
constexpr int64_t kPassL1 = 32 * 1024;
constexpr int64_t kPassBytes = int64_t(1) << 20;

template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ>
void matmul_fmt(const Q8Args& a, int64_t rows) {
  const int64_t blocks = a.K / kBlock;
  constexpr int per = KQ ? 8 : 1;
  std::vector<uint8_t> tiles(static_cast<size_t>(std::max<int64_t>(blocks, 4)) * 512);
  std::vector<BlockScales> scales(static_cast<size_t>(std::max<int64_t>(blocks, 4)));
  configure(SUB ? 16 : kBlock);
  const int64_t bytes = (a.p_end - a.p_begin) * (blocks / per) * a.lay.record;  // this thread's weights
  const bool fits = kPassRows * a.K + blocks * 512 <= kPassL1 && rows * a.K + blocks * 512 > kPassL1;
  const int64_t pass = fits && bytes > kPassBytes ? kPassRows : rows;
  for (int64_t r0 = 0; r0 < rows; r0 += pass) {
    const Q8Args part = rows_from(a, r0);
    const int64_t n = std::min(pass, rows - r0);
    for (int64_t p = a.p_begin; p < a.p_end; ++p) {
      if (n == kRows) {
        panel_one_group<BITS, ZERO, MIN, SUB, KQ>(part, p, tiles.data(), scales.data());
      } else {
        panel<BITS, ZERO, MIN, SUB, KQ>(part, p, n, tiles.data(), scales.data());
      }
    }
  }
  _tile_release();  // the tile state is the thread's only while it is in use
}

}  // namespace

void matmul(const Q8Args& a) {
  const int64_t rows = a.M >= kMinRows ? a.M / kRows * kRows : 0;  // whole tiles; the rest below
  if (rows > 0) {
    steady_fmt::with_format<true>(a.fmt, [&]<steady_fmt::Traits T>() {  // q8linear.cpp refuses other formats
      matmul_fmt<T.bits, T.zero, T.has_min, T.sub_scales, T.k_quant>(a, rows);
    });
  }
  if (rows < a.M) avx512::matmul(rows_from(a, rows));  // the last M mod 16 rows: the same chain in the VNNI build
}

}  // namespace amx
}  // namespace steady_q8
