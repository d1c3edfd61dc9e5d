// Vector primitives in two widths for the attention kernels' ISA-generic bodies
// (chunk_attention_unit.h, decode_attention_unit.h): tokenwire::vec::avx2 (AVX2/FMA, 8 lanes) and
// tokenwire::vec::avx512 (AVX-512F, 16 lanes). A kernel includes its body once per width, inside a
// namespace that brings the width in (`using namespace tokenwire::vec::avx512;`) and defines
// TW_TARGET as the width's attribute (TW_AVX2, TW_AVX512). Every function carries its target
// attribute, so the library is compiled for AVX2 and takes AVX-512 at run time where the CPU has it.
//
// Each width has: Vec (kLanes floats), Zero, Set1, Load, Store, Bcast, Fma, Add, Sub, Mul, Max,
// MaskPast(x, last, key) (x in the lanes whose last visible position >= key, -inf elsewhere),
// Exp (e^x, exactly 0 below -87 and for NaN), HSums(v) (lane i = the sum of v[i]'s lanes, for
// kLanes vectors: a transposing reduction tree, ~2 shuffles a vector) and HMax / HSum of one vector.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

#define TW_AVX2 __attribute__((target("avx2,fma")))
#define TW_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace tokenwire::vec {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Cephes' expf in both widths: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial for e^r, and 2^n
// built in the exponent bits (~1-2 ulp); lanes below -87 (masked scores, -inf) or NaN give exactly 0.
#define TW_EXP_POLY(P)                                      \
  P y = Set1(1.9875691500e-4f);                             \
  y = Fma(y, r, Set1(1.3981999507e-3f));                    \
  y = Fma(y, r, Set1(8.3334519073e-3f));                    \
  y = Fma(y, r, Set1(4.1665795894e-2f));                    \
  y = Fma(y, r, Set1(1.6666665459e-1f));                    \
  y = Fma(y, r, Set1(5.0000001201e-1f));                    \
  y = Fma(y, Mul(r, r), r);                                 \
  y = Add(y, Set1(1.0f));

namespace avx2 {
using Vec = __m256;
constexpr int64_t kLanes = 8;
TW_AVX2 inline Vec Zero() { return _mm256_setzero_ps(); }
TW_AVX2 inline Vec Set1(float x) { return _mm256_set1_ps(x); }
TW_AVX2 inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
TW_AVX2 inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
TW_AVX2 inline Vec Bcast(const float* p) { return _mm256_broadcast_ss(p); }
TW_AVX2 inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
TW_AVX2 inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
TW_AVX2 inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
TW_AVX2 inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
TW_AVX2 inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
TW_AVX2 inline Vec MaskPast(Vec x, const int32_t* last, int32_t key) {
  const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(last));
  const __m256i seen = _mm256_cmpgt_epi32(_mm256_add_epi32(l, _mm256_set1_epi32(1)), _mm256_set1_epi32(key));
  return _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x, _mm256_castsi256_ps(seen));
}
TW_AVX2 inline Vec Exp(Vec x) {
  const Vec dead = _mm256_cmp_ps(x, Set1(-87.0f), _CMP_NGE_UQ);  // and NaN (-inf minus -inf)
  x = _mm256_min_ps(Max(x, Set1(-87.0f)), Set1(88.0f));
  const Vec n = _mm256_round_ps(Mul(x, Set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, Set1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
  TW_EXP_POLY(Vec)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(dead, Mul(y, _mm256_castsi256_ps(e)));
}
// hadd pairs neighbours within each 128-bit half: two levels leave [v0..v3 | v0..v3] partials per
// quad; adding the halves across gives the 8 sums in order.
TW_AVX2 inline Vec HSums(const Vec* v) {
  const Vec t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const Vec t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const Vec u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
TW_AVX2 inline float HSum(Vec v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
TW_AVX2 inline float HMax(Vec v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
}  // namespace avx2

namespace avx512 {
using Vec = __m512;
constexpr int64_t kLanes = 16;
TW_AVX512 inline Vec Zero() { return _mm512_setzero_ps(); }
TW_AVX512 inline Vec Set1(float x) { return _mm512_set1_ps(x); }
TW_AVX512 inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
TW_AVX512 inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
TW_AVX512 inline Vec Bcast(const float* p) { return _mm512_set1_ps(*p); }
TW_AVX512 inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
TW_AVX512 inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
TW_AVX512 inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
TW_AVX512 inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
TW_AVX512 inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
TW_AVX512 inline Vec MaskPast(Vec x, const int32_t* last, int32_t key) {
  const __m512i l = _mm512_loadu_si512(last);
  const __mmask16 seen = _mm512_cmpge_epi32_mask(l, _mm512_set1_epi32(key));
  return _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), seen, x);
}
TW_AVX512 inline Vec Exp(Vec x) {
  const __mmask16 alive = _mm512_cmp_ps_mask(x, Set1(-87.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(Max(x, Set1(-87.0f)), Set1(88.0f));
  const Vec n = _mm512_roundscale_ps(Mul(x, Set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, Set1(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
  TW_EXP_POLY(Vec)
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(alive, Mul(y, _mm512_castsi512_ps(e)));
}
// Four levels, each halving the vectors by adding two shuffles of a pair: 128-bit quarters across
// (shuffle_f32x4), then floats within quarters (shuffle_ps). Lane 4k + j then holds v[4j + k]'s sum,
// and one permute puts the sums in order.
TW_AVX512 inline Vec HSums(const Vec* v) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = Add(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = Add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = Add(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  }
  const Vec d = Add(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}
TW_AVX512 inline float HSum(Vec v) { return _mm512_reduce_add_ps(v); }
TW_AVX512 inline float HMax(Vec v) { return _mm512_reduce_max_ps(v); }
}  // namespace avx512

#undef TW_EXP_POLY

}  // namespace tokenwire::vec
