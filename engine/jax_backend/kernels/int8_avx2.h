// The AVX2 body of int8_matmul.cc, for CPUs without AVX-512 VNNI (AMD before Zen 4, most Intel
// client parts): int8_vnni.h's arithmetic in 256-bit vectors. Included there once, inside its
// `avx2` namespace, after the layout's constants (kBlock, kPanel, kPairBytes, kBlockPairs);
// int8_matmul.cc's header says what the layouts are and why. Deliberately no include guard.
//
// The same numbers as the VNNI path, bit for bit: a row is quantized to the same int16 blocks
// (the same rounding, the same scales and sums), a block's dot is the same exact int32 sum
// (vpmaddwd's pairs, then vpaddd, where VNNI fuses the two), and the float work after it is the
// same operations in the same order per output (AddBlock's). A panel's 16 outputs are two vectors
// of 8, one per half of a pair's 32 bytes. Why integers, not the weights converted to float: a
// float multiply-add takes 8 weights where vpmaddwd takes 16, and each 8 cost a widening and a
// convert first; on an AMD Zen 3 the float path was compute-bound at one row (docs/benchmarks.md).

// One row of K floats -> K int16, K / 32 scales and K / 32 sums, as vnni::QuantizeRow gives them.
inline void QuantizeRow(const float* x, int64_t k, int16_t* xq, float* sx, float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0, j = 0; j < k; ++b, j += kBlock) {
    __m256 v[4];
    for (int t = 0; t < 4; ++t) v[t] = _mm256_loadu_ps(x + j + 8 * t);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    sx[b] = amax / 32767.0f;
    const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    __m256i q[4];
    for (int t = 0; t < 4; ++t) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inverse));  // to nearest, |q| <= 32767
    // packs works within 128-bit lanes: (a0-3, b0-3, a4-7, b4-7), put in order by the permute
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    xsum[b] = sx[b] * static_cast<float>(_mm_cvtsi128_si32(s));  // exact: |sum| < 2^21
  }
}

// Block b's two vectors of int32 sums per row into the MR rows' float accumulators, as
// vnni::AddBlock does it for a vector of 16: the same operations in the same order per output.
template <int MR, bool kOffset>
__attribute__((always_inline)) inline void AddBlock(const __m256i (&dot)[MR][2], const uint16_t* scale,
                                                    const uint16_t* offset, const float* sx, const float* xsum, int64_t b,
                                                    int64_t blocks, __m256 (&acc)[MR][2]) {
  for (int h = 0; h < 2; ++h) {
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + b * kPanel + 8 * h)));
    for (int r = 0; r < MR; ++r)
      acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(ws, _mm256_set1_ps(sx[r * blocks + b])), acc[r][h]);
    if constexpr (kOffset) {
      const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + b * kPanel + 8 * h)));
      for (int r = 0; r < MR; ++r) acc[r][h] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xsum[r * blocks + b]), acc[r][h]);
    }
  }
}

// The panel's `count` outputs of MR rows from their accumulators into y (row r at y + r * n).
template <int MR>
__attribute__((always_inline)) inline void Store(const __m256 (&acc)[MR][2], int64_t count, float* y, int64_t n) {
  for (int h = 0; h < 2; ++h) {
    const int64_t left = count - 8 * h;  // outputs of this half inside the matrix
    if (left >= 8) {
      for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * n + 8 * h, acc[r][h]);
    } else if (left > 0) {
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int r = 0; r < MR; ++r) _mm256_maskstore_ps(y + r * n + 8 * h, lanes, acc[r][h]);
    }
  }
}

// Pair p's two vectors of 8 outputs' weights (32 int8 bytes: `both`), times inputs 2p and 2p + 1
// of MR rows, added to each row's two sums.
template <int MR>
__attribute__((always_inline)) inline void AddPair(__m256i both, const int16_t* xq, int64_t k, int64_t p, __m256i (&dot)[MR][2]) {
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(both));       // outputs 0-7
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(both, 1));  // outputs 8-15
  for (int r = 0; r < MR; ++r) {
    int32_t inputs;
    __builtin_memcpy(&inputs, xq + r * k + 2 * p, sizeof(inputs));  // inputs 2p and 2p + 1 of row r
    const __m256i xb = _mm256_set1_epi32(inputs);
    dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(w0, xb));
    dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(w1, xb));
  }
}

// y[r * n + i] for the panel's `count` outputs i and MR rows r, from int8 pairs: per block, each
// row's exact int32 dots for the two halves of the panel, then AddBlock.
template <int MR, bool kOffset>
void PanelTile(const int8_t* pairs, const uint16_t* scale, const uint16_t* offset, int64_t count, const int16_t* xq,
               const float* sx, const float* xsum, int64_t k, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[MR][2];
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t p = b * kBlockPairs; p < (b + 1) * kBlockPairs; ++p) {
      const int8_t* pair = pairs + p * kPairBytes;
      if (p % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(pair + kAheadBytes), _MM_HINT_T0);
      AddPair<MR>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair)), xq, k, p, dot);
    }
    AddBlock<MR, kOffset>(dot, scale, offset, sx, xsum, b, blocks, acc);
  }
  Store<MR>(acc, count, y, n);
}

// The 32 bits of m as 32 bytes, 0xFF where the bit is set (byte i for bit i).
inline __m256i MaskBytes(uint32_t m) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of m (both lanes hold all four)
      _mm256_set1_epi32(static_cast<int32_t>(m)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201);  // byte i <- bit i % 8
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// 32 nibbles with their fifth bits (int8_matmul.cc's header): unsigned q = nibble + 16 where the
// bit is set; signed q = nibble - 16 (0xF0 | nibble) where it is clear.
template <Fifth F>
__attribute__((always_inline)) inline __m256i WithFifth(__m256i nibbles, uint32_t m) {
  if constexpr (F == Fifth::kNone) return nibbles;
  const __m256i set = MaskBytes(m);
  if constexpr (F == Fifth::kSigned) return _mm256_or_si256(nibbles, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xF0))));
  return _mm256_or_si256(nibbles, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

// The nibble tile: PanelTile over groups of two pairs, each group's 32 bytes (and, for 5 bits,
// its two masks) unpacked in registers once for the MR rows: its low nibbles are pair 2g, its
// high nibbles pair 2g + 1. Offsets for all but signed 5-bit blocks.
template <int MR, Fifth F>
void PanelTileNibbles(const uint8_t* quads, const uint32_t* high, const uint16_t* scale, const uint16_t* offset,
                      int64_t count, const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[MR][2];
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t g = b * kBlockQuads; g < (b + 1) * kBlockQuads; ++g) {
      const uint8_t* group = quads + g * kPairBytes;
      if (g % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(group + kAheadBytes / 2), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group));
      const uint32_t* bits = F != Fifth::kNone ? high + 2 * g : nullptr;
      AddPair<MR>(WithFifth<F>(_mm256_and_si256(v, low), bits ? bits[0] : 0), xq, k, 2 * g, dot);
      AddPair<MR>(WithFifth<F>(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), bits ? bits[1] : 0), xq, k, 2 * g + 1, dot);
    }
    AddBlock<MR, F != Fifth::kSigned>(dot, scale, offset, sx, xsum, b, blocks, acc);
  }
  Store<MR>(acc, count, y, n);
}

// The tiles behind one row dispatch (Panels), as int8_vnni.h's: a layout (int8_matmul.cc) and
// its tile for MR rows.
template <bool kOffsets>
struct Int8Tiles : Int8Layout<kOffsets> {
  template <int MR>
  static void Tile(const int8_t* w, const uint32_t*, const uint16_t* scale, const uint16_t* offset, int64_t count,
                   const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y, int64_t n) {
    PanelTile<MR, kOffsets>(w, scale, offset, count, xq, sx, xsum, k, y, n);
  }
};

template <Fifth F>
struct NibbleTiles : NibbleLayout<F> {
  template <int MR>
  static void Tile(const uint8_t* w, const uint32_t* high, const uint16_t* scale, const uint16_t* offset, int64_t count,
                   const int16_t* xq, const float* sx, const float* xsum, int64_t k, float* y, int64_t n) {
    PanelTileNibbles<MR, F>(w, high, scale, offset, count, xq, sx, xsum, k, y, n);
  }
};

// Rows a pass over a panel: each row holds two vectors of int32 sums, and AVX2 has 16 registers
// (12 sums, the weights, a broadcast); the float accumulators, touched once a block, may live in
// memory.
constexpr int kRows = 6;

// Panels [begin, end) for every row: kRows rows a pass, then the rest.
template <class T>
void Panels(const typename T::Weights* weights, const uint32_t* high, const uint16_t* scale, const uint16_t* offset,
            const int16_t* xq, const float* sx, const float* xsum, int64_t rows, int64_t k, int64_t begin, int64_t end,
            float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  for (int64_t p = begin; p < end; ++p) {
    const PanelAt<T> at(weights, high, scale, offset, k, n, p);
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows)
      T::template Tile<kRows>(at.w, at.high, at.scale, at.offset, at.count, xq + r * k, sx + r * blocks, xsum + r * blocks, k, y + r * n + at.o, n);
    const int16_t* xr = xq + r * k;
    const float* sr = sx + r * blocks;
    const float* mr = xsum + r * blocks;
    float* yr = y + r * n + at.o;
    switch (rows - r) {
      case 0: break;
      case 1: T::template Tile<1>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 2: T::template Tile<2>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 3: T::template Tile<3>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      case 4: T::template Tile<4>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
      default: T::template Tile<5>(at.w, at.high, at.scale, at.offset, at.count, xr, sr, mr, k, yr, n); break;
    }
  }
}
