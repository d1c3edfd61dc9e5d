// tokenwire_panel_matmul: y[R, N] = x[R, K] @ W[K, N] in float32, W given packed in panels of 32
// outputs: p [P, K, 32], p[j, e, c] = W[e, 32 j + c] (zero past N), P = ceil(N / 32). For the
// weight products of decode steps of a few rows and of short prompt chunks on the CPU.
//
// Why: XLA:CPU's product of a few rows streams the weights from memory at 7-13 GB/s on the
// project's machines (22 GB/s for one row), so a decode step of 8 or 32 rows, or a prompt chunk of
// 16 tokens, costs 2-3x the time its bytes need (docs/benchmarks.md). A tile of rows x 32 outputs
// kept in registers while the weights stream past needs those 32 outputs' weights for one input
// to lie together: in W as stored ([in, out]) they are 128 bytes out of every row of N, a strided
// walk that the hardware prefetchers follow poorly (an outer-product tile on W as stored reached
// only 0.6-0.8x of XLA). Packed, each panel is one contiguous stream, read once per call for up
// to kMaxRows rows (and again from L2 for each further block of rows). Each output's sum runs over
// e = 0..K-1 in order, so a row's result does not depend on the other rows of the call.
//
// Two builds of the tile: AVX-512 (rows x 2 vectors of 16) where the CPU has it, AVX2/FMA (rows
// x 4 vectors of 8) elsewhere. The panels are split over pool.h's threads.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // outputs per panel
// Inputs ahead (4 KiB of the panel) that the AVX-512 tile prefetches: left to the hardware
// prefetcher alone, 2-8 rows streamed the weights at 13-18 GB/s on a Sapphire Rapids Xeon, with
// this at 19-23 (8 inputs ahead: 17-23; 64: 18-24; all on 2 shared vCPUs, a noisy host).
// Prefetches past the panel's end are harmless (they never fault).
constexpr int64_t kAhead = 32;

namespace avx512 {
#define TW_TARGET __attribute__((target("avx512f,avx2,fma")))
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weight vectors + a broadcast: 27 of 32 registers

// y[r, 0..cols) = x[r, :] . panel for MR rows (x rows xs apart, y rows ys apart). With `next`
// (on a pass over a panel already in L2), one cache line an input of what follows it is fetched
// into L2 along the way: the next panel's first half on the second pass, its second on the third.
template <int MR>
TW_TARGET void Tile(const float* panel, const float* x, int64_t xs, int64_t k, float* y, int64_t ys, int64_t cols,
                    const float* next) {
  __m512 a[MR][2];
  for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t e = 0; e < k; ++e) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (e + kAhead) * kPanel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (e + kAhead) * kPanel + 16), _MM_HINT_T0);
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + e * 16), _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(panel + e * kPanel), w1 = _mm512_loadu_ps(panel + e * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * xs + e]);
      a[r][0] = _mm512_fmadd_ps(w0, b, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w1, b, a[r][1]);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xffff : (cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1));
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ys, m0, a[r][0]);
    _mm512_mask_storeu_ps(y + r * ys + 16, m1, a[r][1]);
  }
}
#undef TW_TARGET
}  // namespace avx512

namespace avx2 {
#define TW_TARGET __attribute__((target("avx2,fma")))
constexpr int kMaxRows = 3;  // 12 accumulators + 3 broadcasts + a weight vector: 16 of 16 registers

// The tile's inputs [e0, e1): 4 x 8 outputs for MR rows.
template <int MR>
TW_TARGET __attribute__((always_inline)) inline void Inputs(const float* panel, const float* x, int64_t xs, int64_t e0, int64_t e1,
                             __m256 (&a)[MR][4]) {
  for (int64_t e = e0; e < e1; ++e) {
    __m256 b[MR];
    for (int r = 0; r < MR; ++r) b[r] = _mm256_broadcast_ss(x + r * xs + e);
    for (int j = 0; j < 4; ++j) {
      const __m256 w = _mm256_loadu_ps(panel + e * kPanel + 8 * j);
      for (int r = 0; r < MR; ++r) a[r][j] = _mm256_fmadd_ps(w, b[r], a[r][j]);
    }
  }
}

template <int MR>
TW_TARGET void Tile(const float* panel, const float* x, int64_t xs, int64_t k, float* y, int64_t ys, int64_t cols,
                    const char* next, int64_t every) {
  __m256 a[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
  if (next == nullptr) {
    Inputs<MR>(panel, x, xs, 0, k, a);
  } else {  // a cache line of `next` into L2 every `every` inputs
    for (int64_t e = 0; e < k; e += every, next += 64) {
      _mm_prefetch(next, _MM_HINT_T1);
      Inputs<MR>(panel, x, xs, e, std::min(e + every, k), a);
    }
  }
  // Each sum stored once, unconditionally, from a fully unrolled loop, then the outputs inside
  // the matrix copied on. (Stored per row inside a loop GCC did not unroll, or on two paths, a
  // full vector's and a part-filled one's, the 12 sums stayed in memory as well and were stored
  // at every input: 12 stores beside 12 multiply-adds, at half the tile's speed on a Zen 3.)
  alignas(32) float out[MR][kPanel];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm256_store_ps(out[r] + 8 * j, a[r][j]);
  }
  for (int r = 0; r < MR; ++r) std::copy(out[r], out[r] + cols, y + r * ys);
}
#undef TW_TARGET
}  // namespace avx2

// All rows of x through one panel, in the fewest blocks of at most MaxRows, as even as can be
// (16 rows: 8 + 8, not 12 + 4, whose second pass would have few products per weight load).
// With three passes or more (over 24 rows), the second and third fetch `next` (the panel this
// thread does next, or null) into L2. Why: the first pass streams the panel from memory and the
// others find it in L2, so memory sat idle for two thirds of a 32-row product's time, and the
// first pass over each panel waited for it; spread over the two passes, the fetch asks about
// what memory gives. With two passes (13-24 rows) the same fetch measured no faster, so they
// do without (docs/benchmarks.md, "The next panel fetched ahead").
template <int MaxRows, template <int> class TileOf>
void Panel(const float* panel, const float* x, int64_t rows, int64_t k, float* y, int64_t n, int64_t cols,
           const float* next) {
  const int64_t blocks = (rows + MaxRows - 1) / MaxRows;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t m = (rows - r) / (blocks - b);
    const float* ahead = next != nullptr && blocks >= 3 && (b == 1 || b == 2) ? next + (b - 1) * k * 16 : nullptr;
    TileOf<MaxRows>::Run(static_cast<int>(m), panel, x + r * k, k, y + r * n, n, cols, ahead);
    r += m;
  }
}

// The AVX2 tile's passes (3 rows each) over one panel, as Panel's; with `next`, every pass after
// the first fetches an even share of the next panel into L2 (a line every `every` inputs), so that
// memory streams the next panel while the later passes compute from L2, and the next panel's
// first pass finds it there. Why: with 3 rows a pass, the first pass over a 128 KiB panel (1024
// inputs) waits on memory for about as long as the five after it compute (16 rows, an expert's
// share at 64 tokens of top-2 of 8), and memory sits idle during those. Measured in one process
// against the same kernels without it, interleaved (a Zen 3 guest, 2 threads, panels from
// memory): an expert product at 64 tokens 0.82x the time, dense products of 16, 32 and 64 rows
// 0.82x, 0.87x and 0.94x, 8 rows 0.95x; one pass (1-3 rows) is unchanged (docs/notes/cpu-kernels.md,
// "The AVX2 panel tile's next panel fetched ahead").
template <int MaxRows, class Tiles>
void Avx2Panel(const float* panel, const float* x, int64_t rows, int64_t k, float* y, int64_t n, int64_t cols,
               const float* next) {
  const int64_t blocks = (rows + MaxRows - 1) / MaxRows;
  const int64_t lines = k * kPanel * 4 / 64;  // the next panel's cache lines
  const int64_t share = blocks > 1 ? (lines + blocks - 2) / (blocks - 1) : 0;  // lines a later pass fetches
  const int64_t every = share > 0 ? std::max<int64_t>(1, k / share) : 1;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t m = (rows - r) / (blocks - b);
    const char* ahead = next != nullptr && b >= 1 ? reinterpret_cast<const char*>(next) + (b - 1) * share * 64 : nullptr;
    Tiles::Run(static_cast<int>(m), panel, x + r * k, k, y + r * n, n, cols, ahead, every);
    r += m;
  }
}

// Tile<MR> for a row count known only at run time (1..MaxRows).
template <int MaxRows>
struct Avx512Tiles {
  template <int MR>
  static void Call(const float* p, const float* x, int64_t k, float* y, int64_t n, int64_t cols, const float* next) {
    avx512::Tile<MR>(p, x, k, k, y, n, cols, next);
  }
  static void Run(int m, const float* p, const float* x, int64_t k, float* y, int64_t n, int64_t cols,
                  const float* next) {
    switch (m) {
      case 1: return Call<1>(p, x, k, y, n, cols, next);
      case 2: return Call<2>(p, x, k, y, n, cols, next);
      case 3: return Call<3>(p, x, k, y, n, cols, next);
      case 4: return Call<4>(p, x, k, y, n, cols, next);
      case 5: return Call<5>(p, x, k, y, n, cols, next);
      case 6: return Call<6>(p, x, k, y, n, cols, next);
      case 7: return Call<7>(p, x, k, y, n, cols, next);
      case 8: return Call<8>(p, x, k, y, n, cols, next);
      case 9: return Call<9>(p, x, k, y, n, cols, next);
      case 10: return Call<10>(p, x, k, y, n, cols, next);
      case 11: return Call<11>(p, x, k, y, n, cols, next);
      default: return Call<12>(p, x, k, y, n, cols, next);
    }
  }
};

template <int MaxRows>
struct Avx2Tiles {
  // `next`: the slice of the next panel this pass fetches into L2, `every` inputs a line.
  static void Run(int m, const float* p, const float* x, int64_t k, float* y, int64_t n, int64_t cols,
                  const char* next, int64_t every) {
    switch (m) {
      case 1: return avx2::Tile<1>(p, x, k, k, y, n, cols, next, every);
      case 2: return avx2::Tile<2>(p, x, k, k, y, n, cols, next, every);
      default: return avx2::Tile<3>(p, x, k, k, y, n, cols, next, every);
    }
  }
};

std::atomic<int> isa_cap{1};  // 1: AVX-512 where the CPU has it; 0: AVX2 only (tests run both)
bool UseAvx512() { return isa_cap.load() >= 1 && __builtin_cpu_supports("avx512f"); }

ffi::Error PanelMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> p, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = p.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel || xd[1] != pd[1] || yd[0] != xd[0] ||
      yd[1] > pd[0] * kPanel || yd[1] <= (pd[0] - 1) * kPanel) {
    return ffi::Error::InvalidArgument(
        "tokenwire_panel_matmul: expected x [R, K], p [ceil(N / 32), K, 32], y [R, N]");
  }
  const int64_t rows = xd[0], k = xd[1], n = yd[1], panels = pd[0];
  const float* xp = x.typed_data();
  const float* pp = p.typed_data();
  float* yp = y->typed_data();
  const bool wide = UseAvx512();
  // Run splits [0, total) into multiples of 8: 8 units a panel keeps every chunk whole panels.
  tokenwire::Pool::Get().Run(panels * 8, 8, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin / 8; j < end / 8; ++j) {
      const float* panel = pp + j * k * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, n - j * kPanel);
      const float* next = j + 1 < end / 8 ? panel + k * kPanel : nullptr;
      if (wide) {
        Panel<avx512::kMaxRows, Avx512Tiles>(panel, xp, rows, k, yp + j * kPanel, n, cols, next);
      } else {
        Avx2Panel<avx2::kMaxRows, Avx2Tiles<avx2::kMaxRows>>(panel, xp, rows, k, yp + j * kPanel, n, cols, next);
      }
    }
  });
  return ffi::Error::Success();
}

// The experts' product of a mixture of experts (engine.jax_backend.moe): rows x [R, K] sorted by
// expert, sizes [X] rows each, times each one's own expert's W, the experts packed as above: p
// [X, P, K, 32] -> y [R, N]. Each expert with rows streams only its own panels, once per block of
// rows, and an expert no row chose is not read: a decode step reads the experts its tokens chose,
// with no copy of their weights (XLA:CPU gathers them first). The (expert, panel) pairs are split
// over the threads; a row's sums run as in PanelMatmul's.
ffi::Error ExpertPanelMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::S32> sizes,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = p.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 4 || yd.size() != 2 || pd[3] != kPanel || xd[1] != pd[2] || yd[0] != xd[0] ||
      yd[1] > pd[1] * kPanel || yd[1] <= (pd[1] - 1) * kPanel || sizes.element_count() != pd[0]) {
    return ffi::Error::InvalidArgument(
        "tokenwire_expert_panel_matmul: expected x [R, K], p [X, ceil(N / 32), K, 32], sizes [X], y [R, N]");
  }
  const int64_t rows = xd[0], k = xd[1], n = yd[1], experts = pd[0], panels = pd[1];
  const int32_t* count = sizes.typed_data();
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    if (count[e] < 0) return ffi::Error::InvalidArgument("tokenwire_expert_panel_matmul: a negative size");
    start[e + 1] = start[e] + count[e];
  }
  if (start[experts] != rows) {
    return ffi::Error::InvalidArgument("tokenwire_expert_panel_matmul: the sizes do not add up to the rows");
  }
  const float* xp = x.typed_data();
  const float* pp = p.typed_data();
  float* yp = y->typed_data();
  const bool wide = UseAvx512();
  tokenwire::Pool::Get().Run(experts * panels * 8, 8, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin / 8; u < end / 8; ++u) {
      const int64_t e = u / panels, j = u % panels, m = start[e + 1] - start[e];
      if (m == 0) continue;
      const float* panel = pp + (e * panels + j) * k * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, n - j * kPanel);
      const float* xs = xp + start[e] * k;
      float* ys = yp + start[e] * n + j * kPanel;
      if (wide) {
        Panel<avx512::kMaxRows, Avx512Tiles>(panel, xs, m, k, ys, n, cols, nullptr);
      } else {
        int64_t v = u + 1;  // the next unit this thread does with rows: its panel is fetched ahead
        while (v < end / 8 && start[v / panels + 1] == start[v / panels]) ++v;
        const float* next = v < end / 8 ? pp + v * k * kPanel : nullptr;
        Avx2Panel<avx2::kMaxRows, Avx2Tiles<avx2::kMaxRows>>(panel, xs, m, k, ys, n, cols, next);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireExpertPanelMatmul, ExpertPanelMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwirePanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" void TokenwireSetThreads(int n) { tokenwire::Pool::Get().SetThreads(n); }
extern "C" int TokenwireThreads() { return tokenwire::Pool::Get().Threads(); }
extern "C" int TokenwireLastThreads() { return tokenwire::Pool::Get().LastThreads(); }

// Caps the ISA the kernel may use (0: AVX2 only; 1: AVX-512 where the CPU has it) and returns the
// one it now uses (1: AVX-512).
extern "C" int TokenwirePanelMatmulIsa(int cap) {
  isa_cap.store(cap);
  return UseAvx512() ? 1 : 0;
}
