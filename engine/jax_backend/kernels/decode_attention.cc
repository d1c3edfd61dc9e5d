// tokenwire_decode_attention: one decode step's attention on the CPU, read straight from the
// slot KV cache.
//
//   q [R, H, D] f32, k_cache / v_cache [B, K, S, D] f32, positions [R] s32 -> out [R, H * D] f32
//
// Row r is slot r (a step runs the first R slots). Query head h = kv * G + g (G = H / K) attends
// to the slot's keys at positions 0..positions[r]: exactly the live length, not a padded bucket,
// and no copy of the window (XLA:CPU copies a sliced cache window before its batched products,
// and runs those [G, D] x [D, A] products one small matmul at a time).
//
// The work of a (row, kv head) unit is vectorised along the head dimension
// (decode_attention_unit.h), in two builds like chunk_attention.cc's: AVX2/FMA and AVX-512, picked
// at run time where the CPU has AVX-512F (`TokenwireDecodeAttentionIsa(n)` caps the choice; tests
// run both). A head dimension that is no multiple of 8 takes the plain loops of ScalarUnit. Before
// the vector body (scalar exponentials, a horizontal sum per key and head) this kernel took 7.9-8.9
// ms of a ~57 ms 32-row float32 step of SmolLM2 at 64-192 live keys (AMD Zen 5); now 2.6-3.8.
//
// Work is split by (row, kv head): the caller and XLA's intra-op pool take units from a shared
// counter, so rows of different lengths balance. A step too small to be worth a hand-off
// (a few thousand keys) runs on the caller alone.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinKeysPerHelper = 2048;  // below this per extra thread, stay on the caller
// Bytes of keys (and of values) ahead that a unit fetches while it works on the ones before,
// never past its live length. Left to the hardware prefetcher alone, SmolLM2's 30 layers at 32
// rows read their caches at 12.8, 14.3 and 17.0 GB/s at 128, 256 and 448 live keys on a Sapphire
// Rapids Xeon (2 vCPUs); with this at 14.9, 18.1 and 19.5 (medians of four interleaved runs; 8 KiB
// measured the same within the noise). A whole 32-row int8 step at 192 keys: 1.026x.
constexpr int64_t kAheadBytes = 4096;

struct Shape {
  int64_t rows, heads, kv_heads, group, context, dim, cache_slots;
};

inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The vector body in both widths (vec.h); kValueHeads x kValueVecs accumulators fill the registers.
namespace avx2 {
using namespace tokenwire::vec::avx2;
#define TW_TARGET TW_AVX2
constexpr int64_t kValueHeads = 2, kValueVecs = 4;
#include "decode_attention_unit.h"
#undef TW_TARGET
}  // namespace avx2

namespace avx512 {
using namespace tokenwire::vec::avx512;
#define TW_TARGET TW_AVX512
constexpr int64_t kValueHeads = 3, kValueVecs = 4;
#include "decode_attention_unit.h"
#undef TW_TARGET
}  // namespace avx512

// 1: AVX-512 where the CPU has it; 0: AVX2 only (TokenwireDecodeAttentionIsa).
std::atomic<int> isa_cap{1};

bool UseAvx512() { return isa_cap.load() >= 1 && __builtin_cpu_supports("avx512f"); }

// The same unit in plain loops, for a head dimension that is no multiple of 8.
void ScalarUnit(const float* qh, const float* keys, const float* values, int64_t n, int64_t g_count, int64_t d,
                float* oh, std::vector<float>& scores) {
  scores.resize(static_cast<size_t>(g_count * n));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t a = 0; a < n; ++a) {
    const float* k = keys + a * d;
    for (int64_t g = 0; g < g_count; ++g) scores[g * n + a] = Dot(qh + g * d, k, d) * scale;
  }
  for (int64_t g = 0; g < g_count; ++g) {
    float* p = scores.data() + g * n;
    float m = p[0];
    for (int64_t a = 1; a < n; ++a) m = std::max(m, p[a]);
    float total = 0.0f;
    for (int64_t a = 0; a < n; ++a) {
      p[a] = std::exp(p[a] - m);
      total += p[a];
    }
    const float inv = 1.0f / total;
    for (int64_t a = 0; a < n; ++a) p[a] *= inv;
  }
  for (int64_t g = 0; g < g_count; ++g) {
    float* o = oh + g * d;
    std::fill(o, o + d, 0.0f);
    const float* p = scores.data() + g * n;
    for (int64_t a = 0; a < n; ++a) {
      const float* v = values + a * d;
      const float w = p[a];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
    }
  }
}

// One call's work, taken a (row, kv head) unit at a time by the caller and the helpers.
struct Job {
  Job(const Shape& shape, const float* q, const float* k_cache, const float* v_cache, const int32_t* positions,
      float* out)
      : s(shape), q(q), k_cache(k_cache), v_cache(v_cache), positions(positions), out(out),
        units(shape.rows * shape.kv_heads) {}

  const Shape s;
  const float *const q, *const k_cache, *const v_cache;
  const int32_t* const positions;
  float* const out;
  const int64_t units;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};  // helpers inside Run (or about to check `closed`)
  std::atomic<bool> closed{false};  // set by the caller once every unit is done

  void Run() {
    thread_local std::vector<float> scores;
    const bool wide = UseAvx512();
    const int64_t d = s.dim, g_count = s.group;
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
      const int64_t r = u / s.kv_heads, kv = u % s.kv_heads;
      const int64_t n = std::clamp<int64_t>(int64_t{positions[r]} + 1, 1, s.context);
      const float* keys = k_cache + (r * s.kv_heads + kv) * s.context * d;
      const float* values = v_cache + (r * s.kv_heads + kv) * s.context * d;
      const float* qh = q + (r * s.heads + kv * g_count) * d;  // [G, D]
      float* oh = out + (r * s.heads + kv * g_count) * d;      // [G, D]
      if (wide && d % avx512::kLanes == 0) {
        avx512::Unit(qh, keys, values, n, g_count, d, oh, scores);
      } else if (d % avx2::kLanes == 0) {
        avx2::Unit(qh, keys, values, n, g_count, d, oh, scores);
      } else {
        ScalarUnit(qh, keys, values, n, g_count, d, oh, scores);
      }
    }
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), vd = v_cache.dimensions();
  const bool same_caches = vd.size() == cd.size() && std::equal(vd.begin(), vd.end(), cd.begin());
  if (qd.size() != 3 || cd.size() != 4 || !same_caches || qd[2] != cd[3] || qd[0] > cd[0] ||
      qd[1] % cd[1] != 0 || static_cast<int64_t>(positions.element_count()) != qd[0] ||
      out->element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument(
        "tokenwire_decode_attention: expected q [R, H, D], caches [B, K, S, D] with R <= B and K | H, "
        "positions [R], out [R, H * D]");
  }
  const Shape s{qd[0], qd[1], cd[1], qd[1] / cd[1], cd[2], cd[3], cd[0]};
  const int32_t* pp = positions.typed_data();
  const int64_t units = s.rows * s.kv_heads;

  int64_t keys = 0;
  for (int64_t r = 0; r < s.rows; ++r) keys += std::clamp<int64_t>(int64_t{pp[r]} + 1, 1, s.context);
  keys *= s.kv_heads;
  const int64_t helpers =
      std::clamp<int64_t>(std::min<int64_t>(pool.num_threads(), keys / kMinKeysPerHelper), 0, units - 1);

  // The job lives on the heap and is shared with the helpers: a helper that the pool starts only
  // after the caller has finished every unit (all pool threads busy, or a one-core pool whose only
  // thread is the caller) finds the job closed and leaves without touching the buffers, so the
  // caller never waits for a helper that has not started.
  auto job = std::make_shared<Job>(s, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(),
                                   positions.typed_data(), out->typed_data());
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([job] {
      job->active.fetch_add(1);  // seq_cst with `closed`, below and in the caller
      if (!job->closed.load()) job->Run();
      job->active.fetch_sub(1);
    });
  }
  job->Run();
  job->closed.store(true);
  while (job->active.load() != 0) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Caps the ISA the kernel may use (0: AVX2 only; 1: AVX-512 where the CPU has it) and returns the
// one it now uses (0 or 1); tests run both builds on a machine that has both.
extern "C" int TokenwireDecodeAttentionIsa(int cap) {
  isa_cap.store(cap);
  return UseAvx512() ? 1 : 0;
}
