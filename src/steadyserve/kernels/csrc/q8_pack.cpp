// The int8 family's weight packing, in plain C++ (the same code on every CPU): a GGUF matrix into 16-row
// panels (q8.h lists the record), once at load. The activations' quantization is q8_quantize.h.
//
// Bounds of I_c (q8.h), |q| <= 127: 4-bit u - z: 32 * 15 * 127 = 60960; 5-bit: 32 * 31 * 127 = 125984;
// Q8_0: 32 * 128 * 127 = 520192; Q6_K: 2 * 128 * 16 * 32 * 127 = 16646144 < 2^25. The AVX2 build's int16
// pair sums (maddubs): 2 * 63 * 127 = 16002 for the unsigned formats, 2 * 128 * 127 = 32512 for Q8_0 through
// the sign trick (|w| times x with w's sign): below 32767, so nothing saturates; it adds up to kSumRun of them in
// int16 before widening (8, 4, 2 for 4, 5, 6 bits: at most 30480, 31496, 32004; q8_avx2.cpp). MXFP4 stores 4-bit
// indexes whose integers (kMxfp4Stored: u = kvalue + 16 in [4, 28], |u - z| <= 12) are inside the 5-bit bounds,
// which its sums use (formats.h value_bits).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "formats.h"
#include "q8.h"

namespace steady_q8 {
namespace {

using namespace steady_fmt::ids;

uint16_t u16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return h;
}

// One weight row's block c: its stored integers and the GGUF's own scale fields for it, unconverted.
struct Block {
  uint8_t u[32];       // the stored integers (Q8_0: the signed byte's bits)
  uint16_t d = 0;      // binary16: d (every format)
  uint16_t m = 0;      // binary16: Q4_1's m, or the K-quants' dmin
  uint8_t sc = 0;      // Q4_K / Q5_K: the block's 6-bit scale
  uint8_t mn = 0;      // Q4_K / Q5_K: the block's 6-bit min
  int8_t sc_lo = 0;    // Q6_K: the int8 scales of the block's two halves
  int8_t sc_hi = 0;
};

Block read_block(int32_t fmt, const uint8_t* row, int64_t c) {
  Block k;
  if (fmt == Q4_0 || fmt == Q4_1) {  // d * (q - 8) | d * q + m; weights 0-15 low nibbles, 16-31 high
    const uint8_t* b = row + (fmt == Q4_0 ? 18 : 20) * c;
    const uint8_t* qs = b + (fmt == Q4_0 ? 2 : 4);
    k.d = u16_at(b);
    if (fmt == Q4_1) k.m = u16_at(b + 2);
    for (int i = 0; i < 16; ++i) k.u[i] = qs[i] & 15, k.u[16 + i] = qs[i] >> 4;
  } else if (fmt == Q5_0) {  // d * ((q | h << 4) - 16)
    const uint8_t* b = row + 22 * c;
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof qh);
    k.d = u16_at(b);
    for (int i = 0; i < 16; ++i) {
      k.u[i] = uint8_t((b[6 + i] & 15) | (((qh >> i) & 1) << 4));
      k.u[16 + i] = uint8_t((b[6 + i] >> 4) | (((qh >> (16 + i)) & 1) << 4));
    }
  } else if (fmt == Q8_0) {  // d * q
    const uint8_t* b = row + 34 * c;
    k.d = u16_at(b);
    std::memcpy(k.u, b + 2, 32);
  } else if (fmt == MXFP4) {  // kvalue[q] * 2^(e - 128) as d * (kMxfp4Stored[q] - 16): the nibbles kept as Q4_0's
    const uint8_t* b = row + 17 * c;
    for (int i = 0; i < 16; ++i) k.u[i] = b[1 + i] & 15, k.u[16 + i] = b[1 + i] >> 4;
    // d exactly; outside the binary16 range only an all-zero block reaches here (pack's caller checked
    // mxfp4_packable), and its d = +0 changes no output (formats.h).
    const bool exact = b[0] >= steady_fmt::kMxfp4MinExp && b[0] <= steady_fmt::kMxfp4MaxExp;
    k.d = exact ? steady_fmt::e8m0_half_binary16(b[0]) : 0;
  } else if (fmt == Q4_K || fmt == Q5_K) {  // (d * sc) * q - (dmin * m)
    const int s = int(c % 8);
    const uint8_t* b = row + (fmt == Q4_K ? 144 : 176) * (c / 8);
    int sc, mn;
    steady_fmt::scale_min_k4(b + 4, s, &sc, &mn);
    k.d = u16_at(b);
    k.m = u16_at(b + 2);
    k.sc = uint8_t(sc);
    k.mn = uint8_t(mn);
    const uint8_t* qs = b + (fmt == Q4_K ? 16 : 48) + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int i = 0; i < 32; ++i) {
      k.u[i] = uint8_t((qs[i] >> shift) & 15);
      if (fmt == Q5_K) k.u[i] = uint8_t(k.u[i] | (((b[16 + i] >> s) & 1) << 4));
    }
  } else if (fmt == Q6_K) {  // (d * sc) * ((ql | qh << 4) - 32), an int8 scale per 16 weights
    const int s = int(c % 8), h = s / 4, j = s % 4;
    const uint8_t* b = row + 210 * (c / 8);
    const uint8_t* ql = b + 64 * h + 32 * (j % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int qs = 4 * (j / 2), hs = 2 * j;
    k.d = u16_at(b + 208);
    k.sc_lo = int8_t(b[192 + 8 * h + 2 * j]);
    k.sc_hi = int8_t(b[192 + 8 * h + 2 * j + 1]);
    for (int i = 0; i < 32; ++i) k.u[i] = uint8_t(((ql[i] >> qs) & 15) | (((qh[i] >> hs) & 3) << 4));
  }
  return k;
}

}  // namespace

bool packed_layout(int32_t ggml_type, PackedLayout* out) {
  const steady_fmt::Traits* t = steady_fmt::traits(ggml_type);
  if (!t || t->bits == 0) return false;
  *out = {t->bits, t->zero, t->has_min, t->sub_scales, t->k_quant, t->lut, steady_fmt::qbytes(t->bits),
          steady_fmt::record_bytes(*t)};
  return true;
}

bool mxfp4_packable(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, int64_t* bad_row, int64_t* bad_block) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < K / kBlock; ++c) {
      if (!steady_fmt::mxfp4_packs(w + n * row_bytes + 17 * c)) {
        *bad_row = n, *bad_block = c;
        return false;
      }
    }
  }
  return true;
}

void pack(int32_t fmt, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out) {
  PackedLayout lay;
  if (!packed_layout(fmt, &lay) || steady_fmt::row_bytes(fmt, K) != row_bytes) return;  // the caller checked
  const int per = lay.k_quant ? 8 : 1;  // blocks per record
  const int64_t records = K / kBlock / per;
  for (int64_t p = 0; p < N / kPanel; ++p) {
    for (int64_t t = 0; t < records; ++t) {
      uint8_t* rec = out + (p * records + t) * lay.record;
      std::memset(rec, 0, size_t(lay.record));
      uint8_t* scales = rec + per * lay.qbytes;  // the scale fields (q8.h)
      for (int r = 0; r < kPanel; ++r) {
        for (int i = 0; i < per; ++i) {
          const Block k = read_block(fmt, w + (p * kPanel + r) * row_bytes, t * per + i);
          uint8_t* q = rec + i * lay.qbytes;
          std::memcpy(scales + 2 * r, &k.d, 2);  // the same in every block of a super-block
          if (lay.has_min) std::memcpy(scales + steady_fmt::kScaleM + 2 * r, &k.m, 2);
          if (lay.k_quant && lay.has_min)
            scales[steady_fmt::kScaleSc + 16 * i + r] = k.sc, scales[steady_fmt::kScaleMn + 16 * i + r] = k.mn;
          if (lay.sub_scales) {
            scales[steady_fmt::kScaleSub + 16 * (2 * i) + r] = uint8_t(k.sc_lo);
            scales[steady_fmt::kScaleSub + 16 * (2 * i + 1) + r] = uint8_t(k.sc_hi);
          }
          for (int kk = 0; kk < 32; ++kk) {
            const int j = kk / 4, ii = kk % 4;
            if (lay.bits == 8) {
              q[64 * j + 4 * r + ii] = k.u[kk];
              continue;
            }
            const uint8_t lo4 = k.u[kk] & 15;
            if (j < 4) q[64 * j + 4 * r + ii] |= lo4;
            else q[64 * (j - 4) + 4 * r + ii] |= uint8_t(lo4 << 4);
            if (lay.bits == 5) q[256 + 4 * r + ii] |= uint8_t(((k.u[kk] >> 4) & 1) << j);
            if (lay.bits == 6) q[256 + 64 * (j / 4) + 4 * r + ii] |= uint8_t(((k.u[kk] >> 4) & 3) << (2 * (j % 4)));
          }
        }
      }
    }
  }
}

}  // namespace steady_q8
