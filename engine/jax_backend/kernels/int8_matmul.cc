// tokenwire_int8_matmul: y[R, N] = x[R, K] @ W.T in float32, W [N, K] ([out, in]) held as int8
// blocks in panels of 16 outputs:
//
//   x [R, K] f32, pairs [P, K / 2, 16, 2] s8, scale [P, K / 32, 16] f16 -> y [R, N] f32
//   (tokenwire_int8_matmul_offset: also offset [P, K / 32, 16] f16)
//
// W[16 p + i, 2 j + t] = pairs[p, j, i, t] * scale[p, (2 j) / 32, i] (+ offset[p, (2 j) / 32, i])
// (P = ceil(N / 16); outputs past N are zero). The blocks are llama.cpp's Q8_0 (32 inputs of one
// output with one float16 scale: 34 bytes a block, so a step reads the bytes Q8_0 reads; a float32
// scale made it 36); the layout is regrouped once, at load (engine.jax_backend.quantize.Int8Matrix),
// so that one 32-byte load holds the same two inputs of 16 outputs. Weight-only int8 for decode
// steps and short prompt chunks on the CPU. The offsets are llama.cpp's Q4_1 / Q5_1 block minimum
// m (w = d * q + m): a block's products gain m times the sum of the row's inputs over the block,
// one multiply-add per block and row, so those files are served as the values they hold rather
// than requantized.
//
// tokenwire_int4_matmul: the same product over 4-bit blocks, as llama.cpp's Q4_0 and Q4_1 hold
// them (w = d * q + m, q in 0..15; Q4_0's m is -8 d), always with the offset:
//
//   x [R, K] f32, quads [P, K / 4, 16, 2] u8, scale and offset [P, K / 32, 16] f16 -> y [R, N] f32
//
// quads[p, g, i, t] = q[16 p + i, 4 g + t] | q[16 p + i, 4 g + 2 + t] << 4: the low nibbles of a
// 32-byte group are one pair of inputs of the 16 outputs, the high nibbles the next pair, so one
// load, two masks and two widenings give what two loads of the int8 layout give, from half the
// bytes. A block is 20 bytes, Q4_1's own size, 0.56x an 8-bit block with its offset.
//
// tokenwire_int5_matmul (and _offset): 5-bit blocks, as llama.cpp's Q5_0 (w = d * q, q in
// -16..15, no offset) and Q5_1 (w = d * q + m, q in 0..31) hold them:
//
//   x [R, K] f32, quads [P, K / 4, 16, 2] u8, high [P, K / 4, 2] u32, scale (and offset) [P, K / 32, 16] f16
//
// quads holds each q's low four bits as the 4-bit layout does; high[p, g, h] holds the fifth bits
// of the 32 bytes that the low (h = 0) or high (h = 1) nibbles of group g unpack to, bit 2 i + t
// for output i and input 4 g + 2 h + t: a 32-bit mask per unpacked vector, so the fifth bit goes
// in with one masked byte add (q unsigned, 0..31) or subtract (q signed: a clear bit means the
// nibble less 16, two's complement of 0xF0 | nibble) before the widening, all in registers. A
// block is 22 bytes (16 of nibbles, 4 of fifth bits, the scale), Q5_0's own size, against 34
// widened to int8. Why masks and not llama.cpp's plane of 32 bits per block: in the panel layout a
// group's 32 bytes are 16 outputs of 4 inputs each, so the bits that one vector needs are spread
// over 16 blocks' planes; regrouped once at load (engine.jax_backend.quantize.pack) they are one
// mask load. The integer sums are the int8 layout's exactly (the same integers, summed exactly in
// int32), and the scale and offset are applied in the same order, so a product is the same bits
// as the same blocks widened to int8 give, on either path.
//
// Why: decode at small batch is bound by the weight bytes read per token; int8 reads a quarter of
// float32's. XLA:CPU does not fuse an int8-to-float convert into a dot ("dequantize, then dot" ran
// ~15x slower than float32 at one row), so the work happens here, as the bytes stream in.
//
// Why panels: the outputs lie across a vector's 16 lanes, so a block's products for one row are
// 16 vpdpwssd (a pair of the row's inputs, broadcast, against a pair of each output's weights)
// summed exactly in int32, and the two scales apply once per block to 16 outputs; no horizontal
// sums, and a panel's bytes (K * 16) stay in L1 for every row of the call. The regrouping used to
// be done per call with gathers: that was 3x the products' own time on an AMD Zen 5 (its gathers
// are slow), and 16 rows dotted one output at a time paid a convert, a multiply and an add per
// output and block.
//
// Two paths:
// * AVX-512 VNNI (where the CPU has it; int8_vnni.h): each row of x is quantized to int16 blocks of 32 with a
//   float32 scale (max |x| / 32767), so a block's dot is exact in int32 (|sum| <= 32 * 32767 * 128
//   < 2^31). Activations in 16 bits, not 8 as llama.cpp's Q8_0 dot has them: 8 bits flipped
//   near-tie greedy picks of the default model (its answer to "What is the capital of France?"
//   among them); 16 bits give the dequantized weights' float products to float rounding. Up to
//   12 rows a pass over a panel; with fewer than 4 rows each row keeps several independent int32
//   sums, so that the multiply-add chains overlap.
// * AVX2/FMA/F16C elsewhere (and when tests cap the ISA; int8_avx2.h): the same numbers, bit for
//   bit, in 256-bit vectors: the same int16 rows, the same exact int32 block dots (vpmaddwd, then
//   vpaddd), the same float work after them. So a CPU's instruction set never changes an id. Up
//   to 6 rows a pass over a panel.
// Either way the weights are read once per call, and the panels are split over pool.h's threads.

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
constexpr int kPanel = 16;                    // outputs per panel
constexpr int64_t kPairBytes = 2 * kPanel;    // one pair of inputs of the 16 outputs
constexpr int64_t kBlockPairs = kBlock / 2;   // pairs per block
constexpr int64_t kBlockQuads = kBlock / 4;   // 4-bit: groups of two pairs (32 bytes) per block

// How far ahead of the pair being read (in bytes of the panel stream, about one panel of K = 576)
// the tiles prefetch, a line every two pairs. The panels of a thread's range are one contiguous
// stream, but the hardware prefetcher alone kept too few lines in flight: a batch-1 step's 121
// products read from memory (151 MB) took 6.0-6.6 ms without, 4.7-5.0 ms with 8 KiB (4 KiB: 5.6-5.9,
// 16 KiB: 6.4; AMD Zen 5, 2 threads). Prefetches past the array's end are harmless (they never fault).
constexpr int64_t kAheadBytes = 8192;

// How a nibble tile's bytes become integers: 4 bits (q = the nibble), or 5 with the fifth bit
// from `high` (the header above), unsigned (Q5_1, with offsets) or signed (Q5_0, without).
enum class Fifth { kNone, kUnsigned, kSigned };

// A panel's layout by the weights' kind (the header above): their type, a panel's bytes per
// input, whether blocks carry offsets and fifth bits. Each instruction set's tiles (Int8Tiles,
// NibbleTiles in int8_vnni.h and int8_avx2.h) are these with their Tile added.
template <bool kOffsets>
struct Int8Layout {
  using Weights = int8_t;
  static constexpr int64_t kBytesPerInput = kPanel;
  static constexpr bool kOffset = kOffsets;
  static constexpr bool kHigh = false;
};

template <Fifth F>  // kNone: 4 bits, always with offsets; kUnsigned / kSigned: 5 bits
struct NibbleLayout {
  using Weights = uint8_t;
  static constexpr int64_t kBytesPerInput = kPanel / 2;
  static constexpr bool kOffset = F != Fifth::kSigned;
  static constexpr bool kHigh = F != Fifth::kNone;
};

// Panel p of a product in layout L: where its weights, fifth bits (two masks per group of 4
// inputs), scales and offsets start, its first output, and how many of its outputs lie inside
// the matrix of n.
template <class L>
struct PanelAt {
  PanelAt(const typename L::Weights* weights, const uint32_t* fifths, const uint16_t* scales, const uint16_t* offsets,
          int64_t k, int64_t n, int64_t p)
      : w(weights + p * k * L::kBytesPerInput),
        high(L::kHigh ? fifths + p * (k / 4) * 2 : nullptr),
        scale(scales + p * (k / kBlock) * kPanel),
        offset(L::kOffset ? offsets + p * (k / kBlock) * kPanel : nullptr),
        o(p * kPanel),
        count(std::min<int64_t>(kPanel, n - p * kPanel)) {}
  const typename L::Weights* w;
  const uint32_t* high;
  const uint16_t* scale;
  const uint16_t* offset;
  int64_t o, count;
};

namespace vnni {
#include "int8_vnni.h"  // QuantizeRow, the tiles, Panels
}  // namespace vnni

namespace avx2 {
#include "int8_avx2.h"  // the same, in 256-bit vectors and the same numbers
}  // namespace avx2

// Each instruction set's tiles under the same names, for ProductPanels.
struct VnniTiles {
  template <bool kOffset>
  using Int8 = vnni::Int8Tiles<kOffset>;
  template <Fifth F>
  using Nibbles = vnni::NibbleTiles<F>;
  template <class T, class... Args>
  static void Panels(Args... args) { vnni::Panels<T>(args...); }
};

struct Avx2Tiles {
  template <bool kOffset>
  using Int8 = avx2::Int8Tiles<kOffset>;
  template <Fifth F>
  using Nibbles = avx2::NibbleTiles<F>;
  template <class T, class... Args>
  static void Panels(Args... args) { avx2::Panels<T>(args...); }
};

// Panels [begin, end) of one product for every row through one instruction set's tiles, by the
// weights' bits and whether their blocks carry offsets (Product's comment).
template <class Isa>
void ProductPanels(int bits, const void* packed, const uint32_t* high, const uint16_t* sp, const uint16_t* offset,
                   const int16_t* xq, const float* xs, const float* xm, int64_t rows, int64_t k, int64_t begin,
                   int64_t end, float* y, int64_t n) {
  const auto* quads = static_cast<const uint8_t*>(packed);
  const auto* pairs = static_cast<const int8_t*>(packed);
  const uint32_t* none = nullptr;
  if (bits == 5 && offset != nullptr) {
    Isa::template Panels<typename Isa::template Nibbles<Fifth::kUnsigned>>(quads, high, sp, offset, xq, xs, xm, rows, k, begin, end, y, n);
  } else if (bits == 5) {
    Isa::template Panels<typename Isa::template Nibbles<Fifth::kSigned>>(quads, high, sp, offset, xq, xs, xm, rows, k, begin, end, y, n);
  } else if (bits == 4) {
    Isa::template Panels<typename Isa::template Nibbles<Fifth::kNone>>(quads, none, sp, offset, xq, xs, xm, rows, k, begin, end, y, n);
  } else if (offset != nullptr) {
    Isa::template Panels<typename Isa::template Int8<true>>(pairs, none, sp, offset, xq, xs, xm, rows, k, begin, end, y, n);
  } else {
    Isa::template Panels<typename Isa::template Int8<false>>(pairs, none, sp, offset, xq, xs, xm, rows, k, begin, end, y, n);
  }
}

std::atomic<int> isa_cap{1};  // 1: VNNI where the CPU has it; 0: the AVX2 path only (tests run both)
bool UseVnni() {
  return isa_cap.load() >= 1 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw");
}

// The product for every handler: `packed` holds int8 pairs (bits 8) or 4-bit groups (bits 4 and
// 5, `high` the fifth bits for 5), `offset` is null for blocks without offsets, else in scale's
// layout. 4-bit blocks always have offsets; 5-bit ones are signed exactly when they have none.
ffi::Error Product(ffi::Buffer<ffi::F32> x, const void* packed, ffi::Span<const int64_t> pd, int bits, const uint32_t* high,
                   ffi::Buffer<ffi::F16> scale, const uint16_t* offset, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  const int64_t inputs_per_row = bits == 8 ? 2 : 4;  // inputs per 32-byte row of a panel
  if (xd.size() != 2 || pd.size() != 4 || sd.size() != 3 || yd.size() != 2 || yd[0] != xd[0] ||
      xd[1] % kBlock != 0 || pd[1] * inputs_per_row != xd[1] || pd[2] != kPanel || pd[3] != 2 || sd[0] != pd[0] ||
      sd[1] != xd[1] / kBlock || sd[2] != kPanel || pd[0] != (yd[1] + kPanel - 1) / kPanel) {
    return ffi::Error::InvalidArgument(
        "tokenwire_int8_matmul: expected x [R, K] (K a multiple of 32), pairs [ceil(N / 16), K / 2, 16, 2] "
        "(int4, int5: quads [ceil(N / 16), K / 4, 16, 2]), scale (and offset) [ceil(N / 16), K / 32, 16], y [R, N]");
  }
  const int64_t rows = xd[0], k = xd[1], n = yd[1], panels = pd[0];
  const float* xp = x.typed_data();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.typed_data());  // IEEE half bits
  float* yp = y->typed_data();
  const int64_t blocks = k / kBlock;
  // x quantized once, on the calling thread, before the panels are split; the panels are a step
  // of 8 each (Pool::Run cuts its range into multiples of 8)
  const bool vnni = UseVnni();
  thread_local std::vector<int16_t> x16;
  thread_local std::vector<float> sx, xsum;
  x16.resize(rows * k);
  sx.resize(rows * blocks);
  xsum.resize(rows * blocks);
  for (int64_t r = 0; r < rows; ++r) {
    (vnni ? vnni::QuantizeRow : avx2::QuantizeRow)(xp + r * k, k, x16.data() + r * k, sx.data() + r * blocks,
                                                   xsum.data() + r * blocks);
  }
  const int16_t* xq = x16.data();
  const float *xs = sx.data(), *xm = xsum.data();
  tokenwire::Pool::Get().Run(panels * 8, 8, [&](int64_t begin, int64_t end) {
    (vnni ? ProductPanels<VnniTiles> : ProductPanels<Avx2Tiles>)(bits, packed, high, sp, offset, xq, xs, xm, rows, k,
                                                                 begin / 8, end / 8, yp, n);
  });
  return ffi::Error::Success();
}

bool SameShape(ffi::Buffer<ffi::F16> a, ffi::Buffer<ffi::F16> b) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  return ad.size() == bd.size() && std::equal(ad.begin(), ad.end(), bd.begin());
}

const uint16_t* Halves(ffi::Buffer<ffi::F16> a) { return reinterpret_cast<const uint16_t*>(a.typed_data()); }

ffi::Error Int8Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> pairs, ffi::Buffer<ffi::F16> scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  return Product(x, pairs.typed_data(), pairs.dimensions(), 8, nullptr, scale, nullptr, y);
}

ffi::Error Int8MatmulOffset(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> pairs, ffi::Buffer<ffi::F16> scale,
                            ffi::Buffer<ffi::F16> offset, ffi::ResultBuffer<ffi::F32> y) {
  if (!SameShape(scale, offset)) {
    return ffi::Error::InvalidArgument("tokenwire_int8_matmul_offset: offset must have scale's shape [ceil(N / 16), K / 32, 16]");
  }
  return Product(x, pairs.typed_data(), pairs.dimensions(), 8, nullptr, scale, Halves(offset), y);
}

ffi::Error Int4Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> quads, ffi::Buffer<ffi::F16> scale,
                      ffi::Buffer<ffi::F16> offset, ffi::ResultBuffer<ffi::F32> y) {
  if (!SameShape(scale, offset)) {
    return ffi::Error::InvalidArgument("tokenwire_int4_matmul: offset must have scale's shape [ceil(N / 16), K / 32, 16]");
  }
  return Product(x, quads.typed_data(), quads.dimensions(), 4, nullptr, scale, Halves(offset), y);
}

// The 5-bit product, signed without offsets (offset null) or unsigned with them.
ffi::Error Int5Product(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> quads, ffi::Buffer<ffi::U32> high,
                       ffi::Buffer<ffi::F16> scale, const uint16_t* offset, ffi::ResultBuffer<ffi::F32> y) {
  const auto qd = quads.dimensions(), hd = high.dimensions();
  if (qd.size() != 4 || hd.size() != 3 || hd[0] != qd[0] || hd[1] != qd[1] || hd[2] != 2) {
    return ffi::Error::InvalidArgument("tokenwire_int5_matmul: high must be [ceil(N / 16), K / 4, 2] beside quads [ceil(N / 16), K / 4, 16, 2]");
  }
  return Product(x, quads.typed_data(), qd, 5, high.typed_data(), scale, offset, y);
}

ffi::Error Int5Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> quads, ffi::Buffer<ffi::U32> high,
                      ffi::Buffer<ffi::F16> scale, ffi::ResultBuffer<ffi::F32> y) {
  return Int5Product(x, quads, high, scale, nullptr, y);
}

ffi::Error Int5MatmulOffset(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> quads, ffi::Buffer<ffi::U32> high,
                            ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset, ffi::ResultBuffer<ffi::F32> y) {
  if (!SameShape(scale, offset)) {
    return ffi::Error::InvalidArgument("tokenwire_int5_matmul_offset: offset must have scale's shape [ceil(N / 16), K / 32, 16]");
  }
  return Int5Product(x, quads, high, scale, Halves(offset), y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireInt8MatmulOffset, Int8MatmulOffset,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireInt4Matmul, Int4Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireInt5Matmul, Int5Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenwireInt5MatmulOffset, Int5MatmulOffset,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Caps the ISA the kernel may use (0: the AVX2 path; 1: AVX-512 VNNI where the CPU has it)
// and returns the one it now uses (1: VNNI).
extern "C" int TokenwireInt8MatmulIsa(int cap) {
  isa_cap.store(cap);
  return UseVnni() ? 1 : 0;
}
