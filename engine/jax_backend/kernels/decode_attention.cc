// tokenwire_decode_attention: one decode step's attention on the CPU, read straight from the
// paged KV pools.
//
//   q [R, H, D] f32, k_pages / v_pages [K, N, P, D] f32, tables [R, W] s32, positions [R] s32
//   -> out [R, H * D] f32
//
// Row r's position p lives in page tables[r, p / P] at offset p % P (a page of one kv head is P x D
// contiguous values). Query head h = kv * G + g (G = H / K) attends to the row's keys at positions
// 0..positions[r]: exactly the live length, not a padded bucket, and no copy of the window (XLA:CPU
// gathers the pages and copies a window before its batched products, and runs those [G, D] x [D, A]
// products one small matmul at a time).
//
// The work of a (row, kv head) unit is vectorised along the head dimension
// (decode_attention_unit.h), in two builds like chunk_attention.cc's: AVX2/FMA and AVX-512, picked
// at run time where the CPU has AVX-512F (`TokenwireDecodeAttentionIsa(n)` caps the choice; tests
// run both). A head dimension that is no multiple of 8 takes the plain loops of ScalarUnit. Before
// the vector body (scalar exponentials, a horizontal sum per key and head) this kernel took 7.9-8.9
// ms of a ~57 ms 32-row float32 step of SmolLM2 at 64-192 live keys (AMD Zen 5); now 2.6-3.8.
//
// Work is split by (row, kv head) over pool.h's threads, the products' pool: chunks of units are
// taken from a shared counter, so rows of different lengths balance, and one row's kv heads
// already go to different threads. Until 2026-12-05 the units went to XLA's intra-op pool, and
// only above 2,048 keys a helper; that pool's hand-off through a queue cost more than it saved at
// batch 1 (3 units of ~130 keys on the caller alone: 0.83 ms of a ~17 ms float32 step of SmolLM2,
// 0.64 ms on this pool), and at 8 and 32 rows the step was 1.09x and 1.14x faster on this pool
// (docs/benchmarks.md, "The decode attention on the products' pool").
//
// Sliding window (tokenwire_decode_attention_window, attribute `window` >= 1): row r sees only its
// last `window` positions, positions[r] - window + 1 .. positions[r] (transformers' convention,
// transformer.in_window). The pages wholly before them are neither read nor checked; the keys of
// the first page read that lie before the window (fewer than P) are scored and masked (`skip`).
// Without a window (tokenwire_decode_attention) every position from 0 is seen.
//
// Soft-capping (tokenwire_decode_attention_capped, Gemma 2; attributes `window`, 0 for none, and
// `softcap` > 0): each scaled score s becomes softcap * tanh(s / softcap) before the softmax, one
// scalar pass over a unit's scores (CapScores). The other two targets pass softcap 0: no pass.
//
// Attention sinks (tokenwire_decode_attention_sinks, gpt-oss; a sinks [H] operand, attributes
// `window` and `softcap`, 0 for none): each head's sink logit joins its softmax's maximum and
// denominator and has no value, so the head's weights sum to less than 1. The other targets pass
// no sinks: nothing added.
//
// Bounds: a position past the table (positions[r] >= W * P, or < 0: padding or idle rows, whose
// output is unused) is clamped into it, as the contiguous kernel clamped into its cache. A table
// entry that a row would read and that is outside [0, N) is an InvalidArgument error, not clamped:
// it means a corrupt table, and clamping would silently attend to another sequence's keys.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Bytes of keys (and of values) ahead that a unit fetches while it works on the ones before,
// never past its live length. Left to the hardware prefetcher alone, SmolLM2's 30 layers at 32
// rows read their caches at 12.8, 14.3 and 17.0 GB/s at 128, 256 and 448 live keys on a Sapphire
// Rapids Xeon (2 vCPUs); with this at 14.9, 18.1 and 19.5 (medians of four interleaved runs; 8 KiB
// measured the same within the noise). A whole 32-row int8 step at 192 keys: 1.026x. Over pages
// the distance is rounded up to whole pages (PagesAhead: one page of 16 rows at D = 64, two of 8,
// one of 32), and the rows kFarBytes on (at least one page more) are fetched into L2 as well.
//
// Why the second, farther fetch and the first line of every page at a unit's start (Unit): with
// a row's pages scattered over the pool (as they are once many rows' decode steps have taken pages
// in turn), the L1 fetch alone left the paged kernel at 0.63x the contiguous one (8 rows of 256
// keys, one thread; 0.88x on two), where pages in order ran at ~0.95x; in the same runs the L2
// fetch two pages on made that 0.92x (1.14x on two threads), and the first lines another 5-10%
// at 8 and 32 rows. Four pages on into L2, or 8-16 KiB into L1, measured worse. Scattered pages
// still cost 10-35% at 8-32 rows of 256-512 keys, more when the host is loaded, and what sets the
// loss is how many adjacent pages a row has, not address translation (the pools in 2 MiB pages,
// GLIBC_TUNABLES=glibc.malloc.hugetlb=1, lost as much): 32 rows of 512 keys whose pages lie in
// runs of 2, 4 and 8 adjacent pages, the runs scattered over the pool, ran at 0.66x, 0.78x and
// 0.87x, runs of 8 one after another at ~1.0x, pages of 64 positions scattered at 0.81x.
// benchmarks/paged_attention_kernel.py; an AMD EPYC VM shared with other work, where figures move
// 10-25% between runs.
constexpr int64_t kAheadBytes = 4096;
constexpr int64_t kFarBytes = 8192;

struct Shape {
  int64_t rows, heads, kv_heads, group, dim, pages, page_size, width;  // R, H, K, G, D, N, P, W
  int64_t window;                                                      // 0: none (every position from 0)
  float softcap;                                                       // 0: none (Gemma 2's attention soft-cap)
  const float* sinks;                                                  // [H] (gpt-oss's attention sinks); nullptr: none
};

// One row's keys (or values) of one kv head: page[i] holds its positions [i * size, (i + 1) * size).
struct Pages {
  const float* const* page;  // each page's first row ([size, D] contiguous)
  int64_t size;              // P
  int64_t ahead;             // pages ahead whose rows are fetched into L1 while these are read (>= 1)
  int64_t far;               // pages ahead whose rows are fetched into L2 (> ahead)
};

inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// scores [G][np], entries [from, n) of each row: s -> cap * tanh(s / cap) (Gemma 2; the masked
// ones before `from` stay -inf). Scalar: it runs only for capped models.
inline void CapScores(float* scores, int64_t g_count, int64_t np, int64_t from, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t g = 0; g < g_count; ++g) {
    float* p = scores + g * np;
    for (int64_t a = from; a < n; ++a) p[a] = cap * std::tanh(p[a] * inv);
  }
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
void ScalarUnit(const float* qh, const Pages& keys, const Pages& values, int64_t n, int64_t skip, int64_t g_count,
                int64_t d, float softcap, const float* sinks, float* oh, std::vector<float>& scores) {
  scores.resize(static_cast<size_t>(g_count * n));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t a = 0; a < n; ++a) {
    const float* k = keys.page[a / keys.size] + a % keys.size * d;
    for (int64_t g = 0; g < g_count; ++g) scores[g * n + a] = a < skip ? tokenwire::vec::kNegInf : Dot(qh + g * d, k, d) * scale;
  }
  if (softcap > 0.0f) CapScores(scores.data(), g_count, n, skip, n, softcap);
  for (int64_t g = 0; g < g_count; ++g) {
    float* p = scores.data() + g * n;
    float m = p[0];
    for (int64_t a = 1; a < n; ++a) m = std::max(m, p[a]);
    if (sinks != nullptr) m = std::max(m, sinks[g]);
    float total = sinks != nullptr ? std::exp(sinks[g] - m) : 0.0f;
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
      const float* v = values.page[a / values.size] + a % values.size * d;
      const float w = p[a];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += w * v[i];
    }
  }
}

// Pages ahead of the one a unit reads whose rows it fetches: `bytes` of rows, rounded up to pages.
int64_t PagesAhead(const Shape& s, int64_t bytes) {
  const int64_t rows = std::max<int64_t>(1, bytes / (s.dim * static_cast<int64_t>(sizeof(float))));
  return (rows + s.page_size - 1) / s.page_size;
}

// How many keys row r attends to: its position + 1, clamped into its table.
int64_t LiveKeys(const Shape& s, const int32_t* positions, int64_t r) {
  return std::clamp<int64_t>(int64_t{positions[r]} + 1, 1, s.width * s.page_size);
}

// The first page row r reads: the one holding the first position of its window (0 without one).
int64_t FirstPage(const Shape& s, const int32_t* positions, int64_t r) {
  return s.window > 0 ? std::max<int64_t>(0, LiveKeys(s, positions, r) - s.window) / s.page_size : 0;
}

// Units [from, to) of a call: unit u is row u / K, kv head u % K.
void RunUnits(const Shape& s, const float* q, const float* k_pages, const float* v_pages, const int32_t* tables,
              const int32_t* positions, float* out, int64_t from, int64_t to) {
  thread_local std::vector<float> scores;
  thread_local std::vector<const float*> key_pages, value_pages;
  const bool wide = UseAvx512();
  const int64_t d = s.dim, g_count = s.group, page_values = s.page_size * d;
  const int64_t ahead = PagesAhead(s, kAheadBytes), far = std::max(ahead + 1, PagesAhead(s, kFarBytes));
  for (int64_t u = from; u < to; ++u) {
    const int64_t r = u / s.kv_heads, kv = u % s.kv_heads;
    const int64_t live = LiveKeys(s, positions, r), used = (live + s.page_size - 1) / s.page_size;
    // Keys from the first page of the window on: n of them, the first `skip` before the window.
    const int64_t from = FirstPage(s, positions, r), n = live - from * s.page_size;
    const int64_t skip = s.window > 0 ? std::max<int64_t>(0, n - s.window) : 0;
    key_pages.resize(static_cast<size_t>(used - from));
    value_pages.resize(static_cast<size_t>(used - from));
    for (int64_t i = from; i < used; ++i) {
      const int64_t first = (kv * s.pages + tables[r * s.width + i]) * page_values;  // checked in DecodeAttention
      key_pages[i - from] = k_pages + first;
      value_pages[i - from] = v_pages + first;
    }
    const Pages keys{key_pages.data(), s.page_size, ahead, far}, values{value_pages.data(), s.page_size, ahead, far};
    const float* qh = q + (r * s.heads + kv * g_count) * d;  // [G, D]
    float* oh = out + (r * s.heads + kv * g_count) * d;      // [G, D]
    const float* sinks = s.sinks != nullptr ? s.sinks + kv * g_count : nullptr;  // [G]
    if (wide && d % avx512::kLanes == 0) {
      avx512::Unit(qh, keys, values, n, skip, g_count, d, s.softcap, sinks, oh, scores);
    } else if (d % avx2::kLanes == 0) {
      avx2::Unit(qh, keys, values, n, skip, g_count, d, s.softcap, sinks, oh, scores);
    } else {
      ScalarUnit(qh, keys, values, n, skip, g_count, d, s.softcap, sinks, oh, scores);
    }
  }
}

template <typename Dims>
std::string Text(const Dims& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out, int64_t window, float softcap, const float* sinks) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(), td = tables.dimensions();
  const bool same_pools = vd.size() == kd.size() && std::equal(vd.begin(), vd.end(), kd.begin());
  if (qd.size() != 3 || kd.size() != 4 || !same_pools || td.size() != 2 || qd[2] != kd[3] || kd[1] < 1 ||
      kd[2] < 1 || td[1] < 1 || qd[1] % kd[0] != 0 || td[0] != qd[0] ||
      static_cast<int64_t>(positions.element_count()) != qd[0] || out->element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument(
        "tokenwire_decode_attention: expected q [R, H, D], k_pages and v_pages [K, N, P, D] with K | H, "
        "tables [R, W], positions [R], out [R, H * D]; got q " + Text(qd) + ", k_pages " + Text(kd) +
        ", v_pages " + Text(vd) + ", tables " + Text(td) + ", positions " + Text(positions.dimensions()));
  }
  if (window < 0) {
    return ffi::Error::InvalidArgument("tokenwire_decode_attention_window: window must be >= 1, got " +
                                       std::to_string(window));
  }
  if (!(softcap >= 0.0f)) {
    return ffi::Error::InvalidArgument("tokenwire_decode_attention_capped: softcap must be > 0, got " +
                                       std::to_string(softcap));
  }
  const Shape s{qd[0], qd[1], kd[0], qd[1] / kd[0], kd[3], kd[1], kd[2], td[1], window, softcap, sinks};
  const int32_t *tp = tables.typed_data(), *pp = positions.typed_data();
  // Every table entry a row reads must name a page of the pools (the file's header says why this
  // is an error and not clamped); R x ceil(n / P) reads, ~1 us at 32 rows of 512 keys.
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t used = (LiveKeys(s, pp, r) + s.page_size - 1) / s.page_size;
    for (int64_t i = FirstPage(s, pp, r); i < used; ++i) {
      const int32_t page = tp[r * s.width + i];
      if (page < 0 || page >= s.pages) {
        return ffi::Error::InvalidArgument("tokenwire_decode_attention: tables[" + std::to_string(r) + ", " +
                                           std::to_string(i) + "] = " + std::to_string(page) +
                                           " is not a page of the pools (0.." + std::to_string(s.pages - 1) + ")");
      }
    }
  }
  const float *qp = q.typed_data(), *kp = k_pages.typed_data(), *vp = v_pages.typed_data();
  float* op = out->typed_data();
  // 8 pool units a (row, kv head) unit: Run's chunks are multiples of 8.
  tokenwire::Pool::Get().Run(s.rows * s.kv_heads * 8, 8, [&](int64_t begin, int64_t end) {
    RunUnits(s, qp, kp, vp, tp, pp, op, begin / 8, end / 8);
  });
  return ffi::Error::Success();
}

ffi::Error FullAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                         ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                         ffi::ResultBuffer<ffi::F32> out) {
  return DecodeAttention(q, k_pages, v_pages, tables, positions, out, 0, 0.0f, nullptr);
}

ffi::Error WindowAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out, int64_t window) {
  return DecodeAttention(q, k_pages, v_pages, tables, positions, out, window < 1 ? -1 : window, 0.0f, nullptr);
}

// window 0: none; softcap > 0 (a cap of 0 or less is refused: the uncapped targets are for that).
ffi::Error CappedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                           ffi::ResultBuffer<ffi::F32> out, int64_t window, float softcap) {
  return DecodeAttention(q, k_pages, v_pages, tables, positions, out, window, softcap > 0.0f ? softcap : -1.0f, nullptr);
}

// gpt-oss's attention sinks [H] (one logit per query head in its softmax's denominator, no value);
// window 0: none; softcap 0: none (a negative one is refused).
ffi::Error SinksAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> sinks,
                          ffi::ResultBuffer<ffi::F32> out, int64_t window, float softcap) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 || static_cast<int64_t>(sinks.element_count()) != qd[1]) {
    return ffi::Error::InvalidArgument("tokenwire_decode_attention_sinks: expected sinks [H] for q [R, H, D]; got sinks " +
                                       Text(sinks.dimensions()) + ", q " + Text(qd));
  }
  return DecodeAttention(q, k_pages, v_pages, tables, positions, out, window < 0 ? -1 : window,
                         softcap >= 0.0f ? softcap : -1.0f, sinks.typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireDecodeAttention, FullAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireDecodeAttentionWindow, WindowAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireDecodeAttentionCapped, CappedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireDecodeAttentionSinks, SinksAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));

// Caps the ISA the kernel may use (0: AVX2 only; 1: AVX-512 where the CPU has it) and returns the
// one it now uses (0 or 1); tests run both builds on a machine that has both.
extern "C" int TokenwireDecodeAttentionIsa(int cap) {
  isa_cap.store(cap);
  return UseAvx512() ? 1 : 0;
}
