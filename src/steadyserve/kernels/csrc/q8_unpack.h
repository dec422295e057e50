// Unpacking one panel's block of packed weights (q8.h's layout) into the 8 operands the integer sums read.
// Included by q8_body.h (the VNNI and AVX2 builds) and q8_amx.cpp (which stores the operands as an AMX B tile:
// operand j is tile row j, 16 columns of 4 bytes), inside the build's namespace after its lane definitions.

// Weights stream from memory once per call, and the hardware prefetcher alone leaves that stream latency-bound, by
// how much and with which hint depending on the CPU; q8linear.cpp's prefetch_plan holds the measurements and the
// distances. Each block asks for its share of the bytes that far ahead in the stream (records are contiguous,
// panel after panel). A prefetch is a hint: it never faults, even past the end, and never changes a value.
// One hint, in an asm statement, which no optimisation removes: with the hints guarded by a distance read at run
// time, GCC 12 -O3 emitted no prefetch at all in this kernel (__builtin_prefetch or _mm_prefetch alike; checked in
// its assembly), though a minimal loop of the same form keeps them.
inline void prefetch_t0(const uint8_t* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
inline void prefetch_t1(const uint8_t* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Block i's share of the record's cache lines (spread over its `per` blocks), pf.l1 and pf.l2 bytes after rec.
inline void prefetch_ahead(const uint8_t* rec, int32_t record, int per, int i, const Prefetch& pf) {
  const int32_t lines = (record + 63) / 64, l0 = lines * i / per, l1 = lines * (i + 1) / per;
  if (pf.l1 != 0) {
    for (int32_t l = l0; l < l1; ++l) prefetch_t0(rec + pf.l1 + 64 * l);
  }
  if (pf.l2 != 0) {
    for (int32_t l = l0; l < l1; ++l) prefetch_t1(rec + pf.l2 + 64 * l);
  }
}

// The 8 weight operands of one panel's block: operand j holds values 4 j .. 4 j + 3 of every row. A format whose
// nibbles are table indexes (MXFP4: formats.h lut_of) turns each into its integer by the lanes' byte shuffle.
template <int BITS, int ZERO>
inline void unpack(const uint8_t* rec, W (&w)[8]) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) w[j] = wload(rec + 64 * j);
  } else {
    for (int j = 0; j < 4; ++j) {
      const W lo = wload(rec + 64 * j);
      w[j] = wand(lo, 0x0F);
      w[j + 4] = wand(wsrl16(lo, 4), 0x0F);  // 16-bit shifts then a byte mask: no bit crosses a byte
    }
    if constexpr (steady_fmt::lut_of(BITS, ZERO)) {
      for (int j = 0; j < 8; ++j) w[j] = wlut16(w[j], steady_fmt::kMxfp4Stored);
    }
    if constexpr (BITS == 5) {
      const W h = wload(rec + 256);  // bit j of each byte: bit 4 of operand j
      for (int j = 0; j < 8; ++j) w[j] = wor(w[j], wand(j <= 4 ? wsll16(h, 4 - j) : wsrl16(h, j - 4), 0x10));
    } else if constexpr (BITS == 6) {
      const W h[2] = {wload(rec + 256), wload(rec + 320)};  // bits 2jj, 2jj+1: bits 4, 5 of operand 4h + jj
      for (int j = 0; j < 8; ++j) {
        const int s = 2 * (j % 4);
        w[j] = wor(w[j], wand(s <= 4 ? wsll16(h[j / 4], 4 - s) : wsrl16(h[j / 4], s - 4), 0x30));
      }
    }
  }
}

inline int32_t x4_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
