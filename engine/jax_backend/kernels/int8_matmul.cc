// tokenwire_int8_matmul: y[R, N] = x[R, K] @ W.T in float32, W [N, K] ([out, in]) held as int8
// blocks: W[n, j] = q[n, j] * scale[n, j / 32], q int8 [N, K], scale f32 [N, K / 32] (llama.cpp's
// Q8_0 layout, with a float32 scale). Weight-only int8 for decode steps on the CPU.
//
// Why: decode at small batch is bound by the weight bytes read per token; int8 reads a quarter of
// float32's. XLA:CPU does not fuse an int8-to-float convert into a dot ("dequantize, then dot" ran
// ~15x slower than float32 at one row), so the work happens here, as the bytes stream in.
//
// Two paths, the same for every row count of a call:
// * AVX-512 VNNI (where the CPU has it): each row of x is quantized to int16 blocks of 32 with a
//   float32 scale (max |x| / 32767), and each block's dot is one vpdpwssd (32 int16 x int16
//   products into 16 int32 lanes, the weights widened from int8), converted to float and scaled
//   by both blocks' scales. A converted-float dot costs ~20 instructions per 32 weights (widen,
//   convert, multiply-add four times); this ~6. Activations in 16 bits, not 8 as llama.cpp's Q8_0
//   dot has them: 8 bits flipped near-tie greedy picks of the default model (its answer to "What
//   is the capital of France?" among them); 16 bits give the float path's products to float rounding.
//   From 8 rows (kPanelFrom), 16 outputs at a time with the outputs across the vector's lanes
//   (`Panels`: each output's dot of a block is exact in int32, the scales apply once per block).
// * AVX2/FMA elsewhere (and when tests cap the ISA): one row, a fused dequantize-and-dot per output;
//   several rows (2-64), four outputs' rows dequantized once into a float32 buffer in L1 and dotted
//   with the input rows two at a time (a 4 x 2 register tile).
// Either way the weights are read once per call, and the outputs are split over pool.h's threads.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 Load8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// sum_j q[j] * scale[j / 32] * x[j] over one row of K (a multiple of 32).
inline float RowDot(const int8_t* q, const float* scale, const float* x, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0, j = 0; j < k; ++b, j += kBlock) {
    __m256 s0 = _mm256_mul_ps(Load8(q + j), _mm256_loadu_ps(x + j));
    __m256 s1 = _mm256_mul_ps(Load8(q + j + 8), _mm256_loadu_ps(x + j + 8));
    s0 = _mm256_fmadd_ps(Load8(q + j + 16), _mm256_loadu_ps(x + j + 16), s0);
    s1 = _mm256_fmadd_ps(Load8(q + j + 24), _mm256_loadu_ps(x + j + 24), s1);
    acc = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), _mm256_set1_ps(scale[b]), acc);
  }
  return HorizontalSum(acc);
}

inline void Dequantize(const int8_t* q, const float* scale, int64_t k, float* out) {
  for (int64_t b = 0, j = 0; j < k; ++b, j += kBlock) {
    __m256 s = _mm256_set1_ps(scale[b]);
    for (int64_t i = 0; i < kBlock; i += 8) _mm256_storeu_ps(out + j + i, _mm256_mul_ps(Load8(q + j + i), s));
  }
}

// y[r] = w . x[r] for rows r0..r0+3 (each of K floats, K a multiple of 8).
inline void Dot4(const float* w, const float* x, int64_t k, float* y, int64_t stride) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  const float *x0 = x, *x1 = x + k, *x2 = x + 2 * k, *x3 = x + 3 * k;
  for (int64_t j = 0; j < k; j += 8) {
    __m256 v = _mm256_loadu_ps(w + j);
    a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x0 + j), a0);
    a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x1 + j), a1);
    a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x2 + j), a2);
    a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(x3 + j), a3);
  }
  y[0] = HorizontalSum(a0);
  y[stride] = HorizontalSum(a1);
  y[2 * stride] = HorizontalSum(a2);
  y[3 * stride] = HorizontalSum(a3);
}

// y[r][o + i] for i < 4 outputs (w: 4 rows of K) and rows r, r + 1 of x; y's row stride n.
inline void Tile4x2(const float* w, const float* x, int64_t k, float* y, int64_t n) {
  __m256 a[4][2];
  for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  const float* x1 = x + k;
  for (int64_t j = 0; j < k; j += 8) {
    __m256 u = _mm256_loadu_ps(x + j), v = _mm256_loadu_ps(x1 + j);
    for (int i = 0; i < 4; ++i) {
      __m256 wi = _mm256_loadu_ps(w + i * k + j);
      a[i][0] = _mm256_fmadd_ps(wi, u, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(wi, v, a[i][1]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    y[i] = HorizontalSum(a[i][0]);
    y[n + i] = HorizontalSum(a[i][1]);
  }
}

inline float Dot1(const float* w, const float* x, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), a1);
  }
  for (; j < k; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
  return HorizontalSum(_mm256_add_ps(a0, a1));
}

namespace vnni {
#define TW_TARGET __attribute__((target("avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma")))
constexpr int kRows = 4;  // rows per pass over a group of outputs' blocks (4 x 4 accumulators in registers)
constexpr int64_t kAheadOutputs = 8;  // how far ahead (in outputs, two groups) q is prefetched; past q's end is harmless

// One row of K floats -> K int16 and K / 32 scales: xq = round(x / scale), scale = max |x| over the
// block / 32767 (0 for an all-zero block). 16 bits keep x to ~1.5e-5 of its block's largest value:
// the products are the float path's to within float rounding (8-bit activations, as llama.cpp's
// Q8_0 dot has them, flipped near-tie greedy picks of the default model, its first answer among them).
TW_TARGET void QuantizeRow(const float* x, int64_t k, int16_t* xq, float* sx) {
  for (int64_t b = 0, j = 0; j < k; ++b, j += kBlock) {
    const __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    sx[b] = amax / 32767.0f;
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse));  // to nearest, |i| <= 32767
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j), _mm512_cvtsepi32_epi16(i0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + j + 16), _mm512_cvtsepi32_epi16(i1));
  }
}

// y[r * n + i] = sum over blocks b of scale_i[b] * sx[r][b] * (q_i,b . xq_r,b) for NO outputs i
// (rows of q k apart) and MR rows r. A block's dot is one vpdpwssd (32 int16 products into 16
// int32 lanes); NO x MR independent accumulators, so that the multiply-add chains overlap (one
// output at a time was bound by their latency).
template <int NO, int MR>
TW_TARGET void Dots(const int8_t* q, const float* scale, const int16_t* xq, const float* sx, int64_t k, float* y,
                    int64_t n) {
  const int64_t blocks = k / kBlock;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[NO][MR];
  for (int i = 0; i < NO; ++i)
    for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i w[NO];
    __m512 ws[NO];  // the outputs' block scales, broadcast once for all rows
    for (int i = 0; i < NO; ++i) {
      // the same block of the outputs kAheadOutputs further on, one line per two blocks (the
      // hardware prefetcher alone streamed one row at ~12 GB/s, as the AVX2 path did)
      if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(q + (i + kAheadOutputs) * k + b * kBlock), _MM_HINT_T0);
      w[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * k + b * kBlock)));
      ws[i] = _mm512_set1_ps(scale[i * blocks + b]);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = _mm512_loadu_si512(xq + r * k + b * kBlock);
      const __m512 xs = _mm512_set1_ps(sx[r * blocks + b]);
      for (int i = 0; i < NO; ++i) {
        const __m512i dot = _mm512_dpwssd_epi32(zero, xb, w[i]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[i], xs), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NO; ++i)
    for (int r = 0; r < MR; ++r) y[r * n + i] = _mm512_reduce_add_ps(acc[i][r]);
}

// The outputs [begin, end) for every row: NO outputs at a time, their rows of q read once for
// all row groups (kept in L1 after the first).
template <int NO>
TW_TARGET void OutputGroup(const int8_t* q, const float* scale, const int16_t* xq, const float* sx, int64_t rows,
                           int64_t k, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) Dots<NO, kRows>(q, scale, xq + r * k, sx + r * blocks, k, y + r * n, n);
  switch (rows - r) {
    case 3: Dots<NO, 3>(q, scale, xq + r * k, sx + r * blocks, k, y + r * n, n); break;
    case 2: Dots<NO, 2>(q, scale, xq + r * k, sx + r * blocks, k, y + r * n, n); break;
    case 1: Dots<NO, 1>(q, scale, xq + r * k, sx + r * blocks, k, y + r * n, n); break;
    default: break;
  }
}

// Several rows: a panel of 16 outputs at a time, its weights regrouped on the fly so that one
// vector holds the same two inputs of all 16 outputs (pairs[p][i] = q[i][2p], q[i][2p + 1]), and
// each vpdpwssd takes a pair of one row's inputs, broadcast, against it: the 16 lanes are the 16
// outputs, a block's 16 pairs sum in int32 exactly (|sum| <= 32 * 32767 * 128 < 2^31), and the
// scales apply once per block and row to all 16 outputs at once. ~35 instructions per row, block
// and 16 outputs (512 products), where the row dots above take ~6 per 32: at 32 rows the row dots
// ran at half the float32 panels' speed. The regrouping (K * 16 bytes, in L1) is done once per
// panel for all rows.
constexpr int kPanelOutputs = 16;
constexpr int64_t kPanelFrom = 8;  // rows from which the panels run instead of the row dots (about even at 8; 2-4 rows: the row dots up to 2x faster, 16-32: the panels 1.1-1.6x)
constexpr int kPanelRows = 12;  // 12 int32 + 12 float accumulators, a weight vector, a broadcast: 26 of 32 registers

// pairs [K / 2][16][2] int8 from the 16 (or `count`, zero past it) rows of q starting at q: one
// gather of 4 bytes from each row gives two pairs of all 16 outputs (K is a multiple of 32).
TW_TARGET void Regroup(const int8_t* q, int64_t k, int64_t count, int8_t* pairs) {
  const __mmask16 rows = count >= kPanelOutputs ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(k)));
  for (int64_t j = 0; j < k; j += 4) {
    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, offsets, q + j, 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + j / 2 * 2 * kPanelOutputs), _mm512_cvtepi32_epi16(g));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + (j / 2 + 1) * 2 * kPanelOutputs),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
  }
}

template <int MR>
TW_TARGET void PanelTile(const int8_t* pairs, const float* scale, int64_t count, const int16_t* xq, const float* sx,
                         int64_t k, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  const __mmask16 outputs = count >= kPanelOutputs ? 0xffff : static_cast<__mmask16>((1u << count) - 1);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[MR];
    for (int r = 0; r < MR; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t p = b * kBlock / 2; p < (b + 1) * kBlock / 2; ++p) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + p * 2 * kPanelOutputs)));
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        __builtin_memcpy(&pair, xq + r * k + 2 * p, sizeof(pair));  // inputs 2p and 2p + 1 of row r
        dot[r] = _mm512_dpwssd_epi32(dot[r], w, _mm512_set1_epi32(pair));
      }
    }
    // the 16 outputs' scales of block b (scale rows are blocks apart), zero past `count`
    const __m512 ws = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), outputs,
                                               _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                                  _mm512_set1_epi32(static_cast<int>(blocks))),
                                               scale + b, 4);
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(ws, _mm512_set1_ps(sx[r * blocks + b])), acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * n, outputs, acc[r]);
}

TW_TARGET void Panels(const int8_t* q, const float* scale, const int16_t* xq, const float* sx, int64_t rows, int64_t k,
                      int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  thread_local std::vector<int8_t> pairs;
  pairs.resize(k * kPanelOutputs);
  for (int64_t o = begin; o < end; o += kPanelOutputs) {
    const int64_t count = std::min<int64_t>(kPanelOutputs, end - o);
    Regroup(q + o * k, k, count, pairs.data());
    const float* so = scale + o * blocks;
    int64_t r = 0;
    for (; r + kPanelRows <= rows; r += kPanelRows)
      PanelTile<kPanelRows>(pairs.data(), so, count, xq + r * k, sx + r * blocks, k, y + r * n + o, n);
    const int64_t left = rows - r;
    const int16_t* xr = xq + r * k;
    const float* sr = sx + r * blocks;
    float* yr = y + r * n + o;
    switch (left) {
      case 0: break;
      case 1: PanelTile<1>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 2: PanelTile<2>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 3: PanelTile<3>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 4: PanelTile<4>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 5: PanelTile<5>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 6: PanelTile<6>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 7: PanelTile<7>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 8: PanelTile<8>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 9: PanelTile<9>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      case 10: PanelTile<10>(pairs.data(), so, count, xr, sr, k, yr, n); break;
      default: PanelTile<11>(pairs.data(), so, count, xr, sr, k, yr, n); break;
    }
  }
}

TW_TARGET void Outputs(const int8_t* q, const float* scale, const int16_t* xq, const float* sx, int64_t rows,
                       int64_t k, int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  int64_t o = begin;
  for (; o + 4 <= end; o += 4) OutputGroup<4>(q + o * k, scale + o * blocks, xq, sx, rows, k, y + o, n);
  for (; o < end; ++o) OutputGroup<1>(q + o * k, scale + o * blocks, xq, sx, rows, k, y + o, n);
}
#undef TW_TARGET
}  // namespace vnni

std::atomic<int> isa_cap{1};  // 1: VNNI where the CPU has it; 0: the AVX2 float path only (tests run both)
bool UseVnni() {
  return isa_cap.load() >= 1 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
}

ffi::Error Int8Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || xd[1] != qd[1] || qd[1] % kBlock != 0 ||
      sd[0] != qd[0] || sd[1] != qd[1] / kBlock) {
    return ffi::Error::InvalidArgument(
        "tokenwire_int8_matmul: expected x [R, K], q [N, K] (K a multiple of 32), scale [N, K / 32]");
  }
  const int64_t rows = xd[0], n = qd[0], k = qd[1];
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  if (UseVnni()) {
    // x quantized once, on the calling thread, before the outputs are split
    thread_local std::vector<int16_t> x16;
    thread_local std::vector<float> sx;
    x16.resize(rows * k);
    sx.resize(rows * (k / kBlock));
    for (int64_t r = 0; r < rows; ++r) vnni::QuantizeRow(xp + r * k, k, x16.data() + r * k, sx.data() + r * (k / kBlock));
    const int16_t* xq = x16.data();
    const float* xs = sx.data();
    if (rows >= vnni::kPanelFrom) {  // chunks of whole panels (Run cuts multiples of 8; 16 a panel)
      tokenwire::Pool::Get().Run((n + 15) / 16 * 8, 8, [&](int64_t begin, int64_t end) {
        vnni::Panels(qp, sp, xq, xs, rows, k, begin * 2, std::min<int64_t>(end * 2, n), yp, n);
      });
    } else {
      tokenwire::Pool::Get().Run(n, 64, [&](int64_t begin, int64_t end) {
        vnni::Outputs(qp, sp, xq, xs, rows, k, begin, end, yp, n);
      });
    }
    return ffi::Error::Success();
  }
  tokenwire::Pool::Get().Run(n, 64, [&](int64_t begin, int64_t end) {
    if (rows == 1) {
      for (int64_t o = begin; o < end; ++o) yp[o] = RowDot(qp + o * k, sp + o * (k / kBlock), xp, k);
      return;
    }
    thread_local std::vector<float> buffer;
    buffer.resize(4 * k);
    float* w = buffer.data();
    int64_t o = begin;
    for (; o + 4 <= end; o += 4) {  // 4 outputs x 2 rows a tile: each x load feeds 4 products
      for (int i = 0; i < 4; ++i) Dequantize(qp + (o + i) * k, sp + (o + i) * (k / kBlock), k, w + i * k);
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) Tile4x2(w, xp + r * k, k, yp + r * n + o, n);
      for (; r < rows; ++r) {
        for (int i = 0; i < 4; ++i) yp[r * n + o + i] = Dot1(w + i * k, xp + r * k, k);
      }
    }
    for (; o < end; ++o) {
      Dequantize(qp + o * k, sp + o * (k / kBlock), k, w);
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) Dot4(w, xp + r * k, k, yp + r * n + o, n);
      for (; r < rows; ++r) yp[r * n + o] = Dot1(w, xp + r * k, k);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Caps the ISA the kernel may use (0: the AVX2 float path; 1: AVX-512 VNNI where the CPU has it)
// and returns the one it now uses (1: VNNI).
extern "C" int TokenwireInt8MatmulIsa(int cap) {
  isa_cap.store(cap);
  return UseVnni() ? 1 : 0;
}
