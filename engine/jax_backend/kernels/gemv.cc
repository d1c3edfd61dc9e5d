// tokenwire_gemv: y[1, N] = x[1, K] @ w[K, N] in float32, given w as wt [N, K] ([out, in]), for
// the weight products of a one-row decode step on the CPU.
//
// Why: XLA:CPU emits a one-row product as a tiled matrix-vector loop cut into tasks of at least
// 2^19 multiply-adds, so a small model's per-layer products (SmolLM2: 0.3M-1.8M) run as one or
// two uneven tasks, and a step's 120 of them stream the weights at ~20-25 GB/s. Here each output
// is the dot product of one contiguous row of wt with x, four outputs at a time (`Dots`), so the
// weights are read front to back; on one thread that ran the step's layer products in 0.87x XLA's
// time (SmolLM2, batch 1, interleaved A/B on 2 shared vCPUs of an AMD EPYC). On a Sapphire Rapids
// Xeon the four-output tile made batch-1 steps 1.13x faster than one output at a time, and XLA's
// own product was within the noise of it (1.08x, range 0.92-1.36): the kernel is no longer a clear
// win there, and its [out, in] copies cost memory (docs/benchmarks.md). Splitting across XLA's
// intra-op pool was tried and was slower inside a step: the hand-off cost more than it saved; the
// outputs are split instead over pool.h's spinning workers (as many as TokenwireSetThreads says),
// so one row streams the weights on every core the process is given, as llama.cpp's threads do.

#include <immintrin.h>

#include <cstdint>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[i] = w[i] . x for OB consecutive outputs (w: OB rows of K): OB independent streams of the
// weights in flight at once, each with its own accumulators, so neither one row's FMA latency nor
// one stream's prefetching sets the pace (one output at a time read ~0.6x as fast on a Xeon).
template <int OB>
inline void Dots(const float* w, const float* x, int64_t k, float* y) {
  __m256 a[OB][2];
  for (int i = 0; i < OB; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    for (int i = 0; i < OB; ++i) {
      a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * k + j), x0, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i * k + j + 8), x1, a[i][1]);
    }
  }
  for (int i = 0; i < OB; ++i) {
    float s = HorizontalSum(_mm256_add_ps(a[i][0], a[i][1]));
    for (int64_t t = j; t < k; ++t) s += w[i * k + t] * x[t];
    y[i] = s;
  }
}

ffi::Error Gemv(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wt, ffi::ResultBuffer<ffi::F32> y) {
  const auto d = wt.dimensions();
  const auto count = [](size_t n) { return static_cast<int64_t>(n); };
  if (d.size() != 2 || count(x.element_count()) != d[1] || count(y->element_count()) != d[0]) {
    return ffi::Error::InvalidArgument("tokenwire_gemv: expected x [1, K], wt [N, K], y [1, N]");
  }
  const int64_t n = d[0], k = d[1];
  const float* xp = x.typed_data();
  const float* wp = wt.typed_data();
  float* yp = y->typed_data();
  tokenwire::Pool::Get().Run(n, 64, [&](int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + 4 <= end; o += 4) Dots<4>(wp + o * k, xp, k, yp + o);
    for (; o < end; ++o) Dots<1>(wp + o * k, xp, k, yp + o);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireGemv, Gemv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" void TokenwireSetThreads(int n) { tokenwire::Pool::Get().SetThreads(n); }
extern "C" int TokenwireLastThreads() { return tokenwire::Pool::Get().LastThreads(); }
