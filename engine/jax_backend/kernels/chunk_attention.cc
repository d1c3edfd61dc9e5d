// tokenwire_chunk_attention: one prefill chunk's attention on the CPU, read straight from the
// paged KV pools.
//
//   q [C, H, D] f32, k_pages / v_pages [K, N, P, D] f32, table [W] s32, start [] s32
//   -> out [C, H * D] f32
//
// The chunk's queries sit at positions start..start+C-1 of the sequence whose block table is
// `table` (position p: page table[p / P], offset p % P); query i of head h = kv * G + g (G = H / K)
// attends to the keys of kv head kv at positions 0..start+i (causal; its own chunk's keys are
// already written). Only positions [0, start + C) are ever read, so whatever the pages hold past
// the chunk's end (stale values, NaN) changes nothing. D must be a multiple of 8; the caller
// (transformer.prefill_layers) keeps plain JAX otherwise.
//
// Pages: a chunk whose pages are scattered over the pool ran at 0.86-0.89x the contiguous kernel
// (16-token chunks at 256-1,800 keys, two threads, a shared AMD EPYC VM), pages in order at
// 0.98-1.0x; fetching the next key block's rows into L2 while a block's scores are computed did
// not change that (benchmarks/paged_attention_kernel.py), so nothing here fetches ahead.
//
// Sliding window (tokenwire_chunk_attention_window, attribute `window` >= 1): query i sees only
// positions start + i - window + 1 .. start + i (transformers' convention, transformer.in_window).
// A unit's key walk starts at the block holding its first row's first visible key, so the blocks
// before are not read; keys inside the walked blocks that lie before a row's window are masked.
// Without a window (tokenwire_chunk_attention) every position from 0 is seen.
//
// Soft-capping (tokenwire_chunk_attention_capped, Gemma 2; attributes `window`, 0 for none, and
// `softcap` > 0): each scaled score s becomes softcap * tanh(s / softcap) before the masks and the
// online softmax, one scalar pass over each key block's scores. The other two targets pass 0: no pass.
//
// Attention sinks (tokenwire_chunk_attention_sinks, gpt-oss; a sinks [H] operand, attributes
// `window` and `softcap`, 0 for none): each head's sink logit joins its rows' softmax denominators
// (with no value) where they are normalised, after the online softmax and the merge of splits:
// out = o / (l + e^(sink - m)). The other targets pass no sinks: nothing added.
//
// Bounds: positions past the table (start + i >= W * P: a bucket's padding rows) are clamped into
// it, as the contiguous kernel clamped into its cache; their outputs are unused. A table entry the
// chunk reads that is outside [0, N) is an InvalidArgument error, not clamped: it means a corrupt
// table, and clamping would silently attend to another sequence's keys.
//
// Why a kernel: chunked prefill interleaves small chunks (16 tokens) with decode steps, and near
// the end of a long prompt the chunk's attention over ~2,000 cached keys is most of its cost. In
// plain JAX (transformer.chunk_attention, a fori_loop over 256-key blocks) each block is a few
// small batched products with a softmax, copies and masks between them, far from the machine's
// GEMM speed (docs/benchmarks.md, "Prefill"). Here the computation is GEMM-shaped: a work unit is
// one kv head and a tile of chunk positions, G * tile query rows (48 for G = 3 with AVX-512) that
// share every key and value the unit loads; keys are walked in blocks of 128 with an online softmax
// (flash-attention style, so no [rows, S] array); and both products are register-tiled outer-product
// micro-kernels with the rows in vector lanes, reading the cache in place (no copy of the window,
// no transpose of K or V, no horizontal sums: chunk_attention_unit.h). The exponentials are a
// vectorised Cephes-style polynomial (libm's scalar expf would cost as much as the products).
//
// Two builds of that body: AVX2/FMA (8 lanes, tiles of 8 positions: what every machine the kernels
// apply to has) and AVX-512 (16 lanes, tiles of 16), picked at run time where the CPU has AVX-512F,
// because XLA:CPU's own products use it there and it doubles the FMA width (measured ~2x on this
// machine's Xeon). `TokenwireChunkAttentionIsa(n)` caps the choice (tests run both).
//
// Threads: units (kv head x position tile, heaviest tiles first, since a later tile sees more
// keys) are spread over the library's pool (pool.h, `TokenwireSetThreads` threads). A chunk with
// fewer (kv head, tile) pairs than twice the threads also splits each pair's keys into block-aligned
// ranges (flash-decoding style) and merges the partial softmaxes after: a 16-token chunk of SmolLM2
// (3 kv heads) is 3 pairs with AVX-512, so 6 units on 2 threads instead of 3 that leave one idle.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kKeyBlock = 128;  // keys per online-softmax step (a multiple of every kKeys)
using tokenwire::vec::kNegInf;

struct Shape {
  int64_t chunk, heads, kv_heads, group, context, dim, page_size;  // C, H, K, G, W * P, D, P
  int64_t window;                                                  // 0: none (every position from 0)
  float softcap;                                                   // 0: none (Gemma 2's attention soft-cap)
  const float* sinks;                                              // [H] (gpt-oss's attention sinks); nullptr: none
};

// What head h's sink adds to the denominator of a row whose scores' maximum is m (0 without sinks).
inline float SinkTerm(const Shape& s, int64_t h, float m) { return s.sinks != nullptr ? std::exp(s.sinks[h] - m) : 0.0f; }

// The first position a query at `last` sees.
inline int64_t FirstSeen(const Shape& s, int64_t last) { return s.window > 0 ? std::max<int64_t>(0, last - s.window + 1) : 0; }

// Per-thread buffers for a unit, all with rows in the last (contiguous) dimension.
struct Scratch {
  std::vector<float> qt, ot, st, m, l;  // [D][R] queries, [D][R] output, [block][R] scores, [R], [R]
  std::vector<int32_t> last;            // [R] each row's last visible key position
  std::vector<int32_t> from;            // [R] each row's first visible key position (a sliding window's)
};

// The body in both widths (vec.h); the micro-tile sizes fill each width's registers.
namespace avx2 {
using namespace tokenwire::vec::avx2;
#define TW_TARGET TW_AVX2
constexpr int64_t kKeys = 4, kCols = 4, kTile = 8;
#include "chunk_attention_unit.h"
#undef TW_TARGET
}  // namespace avx2

namespace avx512 {
using namespace tokenwire::vec::avx512;
#define TW_TARGET TW_AVX512
constexpr int64_t kKeys = 8, kCols = 8, kTile = 16;
#include "chunk_attention_unit.h"
#undef TW_TARGET
}  // namespace avx512

// 1: AVX-512 where the CPU has it; 0: AVX2 only (TokenwireChunkAttentionIsa).
std::atomic<int> isa_cap{1};

bool UseAvx512() { return isa_cap.load() >= 1 && __builtin_cpu_supports("avx512f"); }

// out = the splits' partial softmaxes combined: each row's max m = max_i m_i, its sum
// l = sum_i l_i e^(m_i - m) and its output (sum_i o_i e^(m_i - m)) / l. A split a row saw no key in
// has m_i = -inf and weighs 0 (every row sees its own key, in some split).
void Merge(const Shape& s, const float* parts, int64_t tiles, int64_t tile, int64_t splits, int64_t part_size,
           float* out) {
  const int64_t d = s.dim;
  std::vector<float> weight(static_cast<size_t>(splits));
  for (int64_t pair = 0; pair < tiles * s.kv_heads; ++pair) {
    const int64_t t = tiles - 1 - pair / s.kv_heads, kv = pair % s.kv_heads;
    const int64_t c0 = t * tile, c1 = std::min(s.chunk, c0 + tile), rows = (c1 - c0) * s.group;
    const float* first = parts + pair * splits * part_size;
    for (int64_t r = 0; r < rows; ++r) {
      float m = kNegInf, l = 0.0f;
      for (int64_t i = 0; i < splits; ++i) m = std::max(m, first[i * part_size + r]);
      for (int64_t i = 0; i < splits; ++i) {
        const float mi = first[i * part_size + r];
        weight[i] = mi == kNegInf ? 0.0f : std::exp(mi - m);
        l += weight[i] * first[i * part_size + rows + r];
      }
      const int64_t ci = r / s.group, g = r % s.group;
      float* dst = out + ((c0 + ci) * s.heads + kv * s.group + g) * d;
      for (int64_t e = 0; e < d; ++e) {
        float o = 0.0f;
        for (int64_t i = 0; i < splits; ++i) {
          if (weight[i] != 0.0f) o += weight[i] * first[i * part_size + 2 * rows + r * d + e];
        }
        dst[e] = o / (l + SinkTerm(s, kv * s.group + g, m));
      }
    }
  }
}

template <typename Dims>
std::string Text(const Dims& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error ChunkAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> out,
                          int64_t window, float softcap, const float* sinks) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(), td = table.dimensions();
  const bool same_pools = vd.size() == kd.size() && std::equal(vd.begin(), vd.end(), kd.begin());
  if (qd.size() != 3 || kd.size() != 4 || !same_pools || td.size() != 1 || td[0] < 1 || kd[1] < 1 || kd[2] < 1 ||
      qd[2] != kd[3] || qd[2] % 8 != 0 || qd[0] < 1 || qd[1] % kd[0] != 0 || start.element_count() != 1 ||
      out->element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument(
        "tokenwire_chunk_attention: expected q [C, H, D] with D a multiple of 8, k_pages and v_pages "
        "[K, N, P, D] with K | H, table [W], start [], out [C, H * D]; got q " + Text(qd) + ", k_pages " +
        Text(kd) + ", v_pages " + Text(vd) + ", table " + Text(td) + ", start " + Text(start.dimensions()));
  }
  if (window < 0) {
    return ffi::Error::InvalidArgument("tokenwire_chunk_attention_window: window must be >= 1, got " +
                                       std::to_string(window));
  }
  if (!(softcap >= 0.0f)) {
    return ffi::Error::InvalidArgument("tokenwire_chunk_attention_capped: softcap must be > 0, got " +
                                       std::to_string(softcap));
  }
  const Shape s{qd[0], qd[1], kd[0], qd[1] / kd[0], td[0] * kd[2], kd[3], kd[2], window, softcap, sinks};
  const int64_t lo = std::clamp<int64_t>(start.typed_data()[0], 0, s.context - 1);  // see the header: bounds
  // Each kv head's pages that the chunk reads, checked to be pages of the pools (the header says
  // why an entry outside them is an error).
  const int64_t used = (std::min(lo + s.chunk, s.context) + s.page_size - 1) / s.page_size, pages = kd[1];
  const int64_t page_values = s.page_size * s.dim;
  std::vector<const float*> key_pages(static_cast<size_t>(s.kv_heads * used)), value_pages(key_pages.size());
  for (int64_t i = 0; i < used; ++i) {
    const int32_t page = table.typed_data()[i];
    if (page < 0 || page >= pages) {
      return ffi::Error::InvalidArgument("tokenwire_chunk_attention: table[" + std::to_string(i) + "] = " +
                                         std::to_string(page) + " is not a page of the pools (0.." +
                                         std::to_string(pages - 1) + ")");
    }
    for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
      key_pages[kv * used + i] = k_pages.typed_data() + (kv * pages + page) * page_values;
      value_pages[kv * used + i] = v_pages.typed_data() + (kv * pages + page) * page_values;
    }
  }
  const bool wide = UseAvx512();
  const int64_t tile = wide ? avx512::kTile : avx2::kTile;
  const int64_t tiles = (s.chunk + tile - 1) / tile;
  // A chunk with fewer (kv head, tile) pairs than twice the threads (a 16-token chunk: 3 pairs)
  // also splits each pair's keys, so that every thread has work; the splits are merged below.
  const int64_t threads = tokenwire::Pool::Get().Threads(), pairs = tiles * s.kv_heads;
  const int64_t blocks = (std::min(lo + s.chunk, s.context) + kKeyBlock - 1) / kKeyBlock - FirstSeen(s, lo) / kKeyBlock;
  const int64_t splits =
      threads < 2 ? 1 : std::clamp<int64_t>((2 * threads + pairs - 1) / pairs, 1, std::max<int64_t>(1, blocks / 2));
  const int64_t units = pairs * splits, rows = tile * s.group, part_size = rows * (s.dim + 2);
  std::vector<float> parts(splits > 1 ? static_cast<size_t>(units * part_size) : 0);
  const float* qp = q.typed_data();
  float* op = out->typed_data();
  // Units scaled by 8: the pool cuts its range into multiples of 8, so one unit is one step of 8.
  tokenwire::Pool::Get().Run(units * 8, 8, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t u = begin / 8; u < end / 8; ++u) {
      const int64_t pair = u / splits, split = u % splits;
      const int64_t t = tiles - 1 - pair / s.kv_heads, kv = pair % s.kv_heads;  // heaviest tiles first
      const float *const *kp = &key_pages[kv * used], *const *vp = &value_pages[kv * used];
      const int64_t c0 = t * tile, c1 = std::min(s.chunk, c0 + tile);
      float* part = splits > 1 ? &parts[u * part_size] : nullptr;
      if (wide) {
        avx512::Unit(s, qp, kp, vp, lo, op, kv, c0, c1, split, splits, part, scratch);
      } else {
        avx2::Unit(s, qp, kp, vp, lo, op, kv, c0, c1, split, splits, part, scratch);
      }
    }
  });
  if (splits > 1) Merge(s, parts.data(), tiles, tile, splits, part_size, op);
  return ffi::Error::Success();
}

ffi::Error FullAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                         ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> out) {
  return ChunkAttention(q, k_pages, v_pages, table, start, out, 0, 0.0f, nullptr);
}

ffi::Error WindowAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> out,
                           int64_t window) {
  return ChunkAttention(q, k_pages, v_pages, table, start, out, window < 1 ? -1 : window, 0.0f, nullptr);
}

// window 0: none; softcap > 0 (a cap of 0 or less is refused: the uncapped targets are for that).
ffi::Error CappedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> out,
                           int64_t window, float softcap) {
  return ChunkAttention(q, k_pages, v_pages, table, start, out, window, softcap > 0.0f ? softcap : -1.0f, nullptr);
}

// gpt-oss's attention sinks [H]; window 0: none; softcap 0: none (a negative one is refused).
ffi::Error SinksAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> sinks,
                          ffi::ResultBuffer<ffi::F32> out, int64_t window, float softcap) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 || static_cast<int64_t>(sinks.element_count()) != qd[1]) {
    return ffi::Error::InvalidArgument("tokenwire_chunk_attention_sinks: expected sinks [H] for q [C, H, D]; got sinks " +
                                       Text(sinks.dimensions()) + ", q " + Text(qd));
  }
  return ChunkAttention(q, k_pages, v_pages, table, start, out, window < 0 ? -1 : window,
                        softcap >= 0.0f ? softcap : -1.0f, sinks.typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireChunkAttention, FullAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireChunkAttentionWindow, WindowAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireChunkAttentionCapped, CappedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireChunkAttentionSinks, SinksAttention,
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
extern "C" int TokenwireChunkAttentionIsa(int cap) {
  isa_cap.store(cap);
  return UseAvx512() ? 1 : 0;
}
