// tokenwire_int8_matmul: y[R, N] = x[R, K] @ W.T in float32, W [N, K] ([out, in]) held as int8
// blocks: W[n, j] = q[n, j] * scale[n, j / 32], q int8 [N, K], scale f32 [N, K / 32] (llama.cpp's
// Q8_0 layout, with a float32 scale). Weight-only int8 for decode steps on the CPU.
//
// Why: decode at small batch is bound by the weight bytes read per token; int8 reads a quarter of
// float32's. XLA:CPU does not fuse an int8-to-float convert into a dot ("dequantize, then dot" ran
// ~15x slower than float32 at one row), so the convert happens here, in registers, as the bytes
// stream in. One row: each output is a fused dequantize-and-dot over its row of q. Several rows
// (2-64: decode batches, short prompt chunks): four outputs' rows are dequantized once into a
// float32 buffer in L1 and dotted with the input rows two at a time (a 4 x 2 register tile, so
// each input load feeds four products; 1.25x faster than one output x four rows at 32 rows), so
// the weights are still read once per call. Still ~1.6x slower than XLA's float32 GEMM at 32
// rows (arithmetic-bound there; a wider tile or int8 x int8 dots are the next step). The outputs
// are split over pool.h's threads.

#include <immintrin.h>

#include <algorithm>
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
