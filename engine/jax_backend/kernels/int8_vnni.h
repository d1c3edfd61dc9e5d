// The AVX-512 VNNI body of int8_matmul.cc: the activations' int16 quantization, the int8 and the
// nibble (4- and 5-bit) panel tiles, and the row dispatch over a thread's panels. Included there
// once, inside its `vnni` namespace, after the layout's constants (kBlock, kPanel, kPairBytes,
// kBlockPairs, kBlockQuads); int8_matmul.cc's header says what the layouts are and why.
// Deliberately no include guard (as chunk_attention_unit.h).

#define TW_TARGET __attribute__((target("avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")))
constexpr int kRows = 12;  // rows per pass: 12 int32 + 12 float accumulators, a weight vector, a broadcast

// One row of K floats -> K int16, K / 32 scales and K / 32 sums: xq = round(x / scale), scale =
// max |x| over the block / 32767 (0 for an all-zero block), sum = scale * the block's xq summed (the
// quantized inputs' own sum, for the offsets). 16 bits keep x to ~1.5e-5 of its block's largest value.
TW_TARGET void QuantizeRow(const float* x, int64_t k, int16_t* xq, float* sx, float* xsum) {
  for (int64_t b = 0, j = 0; j < k; ++b, j += kBlock) {
    const __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    sx[b] = amax / 32767.0f;
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));  // to nearest, |i| <= 32767
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j), _mm512_cvtsepi32_epi16(i0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j + 16), _mm512_cvtsepi32_epi16(i1));
    xsum[b] = sx[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));  // exact: |sum| < 2^21
  }
}

// Block b's S int32 sums per row into the MR rows' float accumulators: added, scaled by block b's
// 16 weight scales and each row's input scale, and with kOffset plus block b's 16 offsets times
// each row's input sum. Shared by both tiles, so their float arithmetic is the same operations in
// the same order (the nibble tiles' bit-for-bit equality with the int8 tile rests on it).
template <int MR, int S, bool kOffset>
TW_TARGET __attribute__((always_inline)) inline void AddBlock(
    const __m512i (&dot)[MR][S], const uint16_t* scale, const uint16_t* offset, const float* sx, const float* xsum,
    int64_t b, int64_t blocks, __m512 (&acc)[MR]) {
  const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + b * kPanel)));
  for (int r = 0; r < MR; ++r) {
    __m512i d = dot[r][0];
    for (int t = 1; t < S; ++t) d = _mm512_add_epi32(d, dot[r][t]);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws, _mm512_set1_ps(sx[r * blocks + b])), acc[r]);
  }
  if constexpr (kOffset) {
    const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(offset + b * kPanel)));
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xsum[r * blocks + b]), acc[r]);
  }
}

// y[r * n + i] for the panel's `count` outputs i and MR rows r; S independent int32 sums per row
// (each taking every S-th pair of a block), added at the block's end. With kOffset, each block
// also adds offset * xsum (the row's inputs summed over the block).
template <int MR, int S, bool kOffset>
TW_TARGET void PanelTile(const int8_t* pairs, const uint16_t* scale, const uint16_t* offset, int64_t count,
                         const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y, int64_t n) {
  static_assert(kBlockPairs % S == 0, "S must divide a block's pairs");
  const int64_t blocks = k / kBlock;
  const __mmask16 outputs = count >= kPanel ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][S];
    for (int r = 0; r < MR; ++r)
      for (int t = 0; t < S; ++t) dot[r][t] = _mm512_setzero_si512();
    for (int64_t p = b * kBlockPairs; p < (b + 1) * kBlockPairs; p += S) {
      for (int t = 0; t < S; ++t) {
        if (kAheadBytes > 0 && (p + t) % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(pairs + (p + t) * kPairBytes + kAheadBytes), _MM_HINT_T0);
        const __m512i w =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + (p + t) * kPairBytes)));
        for (int r = 0; r < MR; ++r) {
          int32_t pair;
          __builtin_memcpy(&pair, xq + r * k + 2 * (p + t), sizeof(pair));  // inputs 2p and 2p + 1 of row r
          dot[r][t] = _mm512_dpwssd_epi32(dot[r][t], w, _mm512_set1_epi32(pair));
        }
      }
    }
    AddBlock<MR, S, kOffset>(dot, scale, offset, sx, xsum, b, blocks, acc);
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * n, outputs, acc[r]);
}

// The nibble tile: PanelTile's sums over groups of two pairs, each group's 32 bytes (and, for 5
// bits, its two 32-bit masks) unpacked once for the MR rows; offsets for all but signed 5-bit
// blocks (module comment). The prefetch runs the same time ahead as the int8 tile's.
template <int MR, int S, Fifth F>
TW_TARGET void PanelTileNibbles(const uint8_t* quads, const uint32_t* high, const uint16_t* scale, const uint16_t* offset,
                                int64_t count, const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y,
                                int64_t n) {
  static_assert(kBlockQuads % S == 0, "S must divide a block's groups");
  constexpr bool kOffset = F != Fifth::kSigned;
  const int64_t blocks = k / kBlock;
  const __mmask16 outputs = count >= kPanel ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR][S];
    for (int r = 0; r < MR; ++r)
      for (int t = 0; t < S; ++t) dot[r][t] = _mm512_setzero_si512();
    for (int64_t g = b * kBlockQuads; g < (b + 1) * kBlockQuads; g += S) {
      for (int t = 0; t < S; ++t) {
        const uint8_t* group = quads + (g + t) * kPairBytes;
        if (kAheadBytes > 0 && (g + t) % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(group + kAheadBytes / 2), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group));
        __m256i b0 = _mm256_and_si256(v, low);                          // inputs 4g, 4g + 1
        __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);   // inputs 4g + 2, 4g + 3
        if constexpr (F != Fifth::kNone) {
          const uint32_t* bits = high + 2 * (g + t);
          if (kAheadBytes > 0 && (g + t) % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(bits) + kAheadBytes / 8, _MM_HINT_T0);
          const __mmask32 m0 = _cvtu32_mask32(bits[0]), m1 = _cvtu32_mask32(bits[1]);
          if constexpr (F == Fifth::kUnsigned) {
            b0 = _mm256_mask_add_epi8(b0, m0, b0, sixteen);
            b1 = _mm256_mask_add_epi8(b1, m1, b1, sixteen);
          } else {  // a clear fifth bit: q = nibble - 16
            b0 = _mm256_mask_sub_epi8(b0, _knot_mask32(m0), b0, sixteen);
            b1 = _mm256_mask_sub_epi8(b1, _knot_mask32(m1), b1, sixteen);
          }
        }
        const __m512i w0 = _mm512_cvtepi8_epi16(b0), w1 = _mm512_cvtepi8_epi16(b1);  // q in -16..31 either way
        for (int r = 0; r < MR; ++r) {
          int32_t first, second;
          __builtin_memcpy(&first, xq + r * k + 4 * (g + t), sizeof(first));
          __builtin_memcpy(&second, xq + r * k + 4 * (g + t) + 2, sizeof(second));
          dot[r][t] = _mm512_dpwssd_epi32(dot[r][t], w0, _mm512_set1_epi32(first));
          dot[r][t] = _mm512_dpwssd_epi32(dot[r][t], w1, _mm512_set1_epi32(second));
        }
      }
    }
    AddBlock<MR, S, kOffset>(dot, scale, offset, sx, xsum, b, blocks, acc);
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * n, outputs, acc[r]);
}

// The tiles behind one row dispatch (Panels): a layout (int8_matmul.cc) and its tile for MR rows
// with S sums each. `high` is the panel's fifth bits (5-bit tiles only; null otherwise).
template <bool kOffsets>
struct Int8Tiles : Int8Layout<kOffsets> {
  template <int MR, int S>
  TW_TARGET static void Tile(const int8_t* w, const uint32_t*, const uint16_t* scale, const uint16_t* offset, int64_t count,
                             const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y, int64_t n) {
    PanelTile<MR, S, kOffsets>(w, scale, offset, count, xq, sx, xsum, k, y, n);
  }
};

template <Fifth F>
struct NibbleTiles : NibbleLayout<F> {
  template <int MR, int S>
  TW_TARGET static void Tile(const uint8_t* w, const uint32_t* high, const uint16_t* scale, const uint16_t* offset,
                             int64_t count, const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y,
                             int64_t n) {
    PanelTileNibbles<MR, S, F>(w, high, scale, offset, count, xq, sx, xsum, k, y, n);
  }
};

// Panels [begin, end) for every row: kRows rows a pass, then the rest (one or two rows take more
// independent sums: a lone row's dot products would otherwise wait on each other).
template <class T>
TW_TARGET void Panels(const typename T::Weights* weights, const uint32_t* high, const uint16_t* scale, const uint16_t* offset,
                      const int16_t* xq, const float* sx, const float* xsum, int64_t rows, int64_t k, int64_t begin,
                      int64_t end, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  for (int64_t p = begin; p < end; ++p) {
    const PanelAt<T> at(weights, high, scale, offset, k, n, p);
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows)
      T::template Tile<kRows, 1>(at.w, at.high, at.scale, at.offset, at.count, xq + r * k, sx + r * blocks, xsum + r * blocks, k, y + r * n + at.o, n);
    const int16_t* xr = xq + r * k;
    const float* sr = sx + r * blocks;
    const float* mr = xsum + r * blocks;
    float* yr = y + r * n + at.o;
    switch (rows - r) {
      case 0: break;
      case 1: T::template Tile<1, 4>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 2: T::template Tile<2, 2>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 3: T::template Tile<3, 2>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 4: T::template Tile<4, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 5: T::template Tile<5, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 6: T::template Tile<6, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 7: T::template Tile<7, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 8: T::template Tile<8, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 9: T::template Tile<9, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 10: T::template Tile<10, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      default: T::template Tile<11, 1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
    }
  }
}
#undef TW_TARGET
