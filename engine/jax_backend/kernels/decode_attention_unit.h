// The ISA-generic body of decode_attention.cc: one work unit (a row and a kv head: the G query heads
// that share the slot's keys), written once and included there twice, for AVX2 and for AVX-512,
// each inside its own namespace, which brings in that width's primitives (vec.h) and defines
// kValueHeads (query heads per P . V pass), kValueVecs (vectors of value columns per pass) and
// TW_TARGET. D must be a multiple of kLanes. Deliberately no include guard.
//
// Layout: a decode row has G (3 for SmolLM2) queries, too few to fill vector lanes as the chunk
// kernel does with its rows. So here the head dimension lies in the lanes:
// - scores: a key's dot product with a query is D / kLanes fused multiply-adds into one vector of
//   partial sums; kLanes keys' vectors are reduced together by one transposing tree (HSums), which
//   leaves their kLanes scores in one vector, in key order (~2 shuffles a key instead of a
//   horizontal sum each);
// - softmax: vertical over the scores [G][n], with the vectorised exponential;
// - P . V: each value row is loaded once per pass and multiplied into the accumulators of up to
//   kValueHeads heads x kValueVecs column vectors, held in registers over all n keys.
// Keys and values are read in place from the cache, only positions 0..n-1.

// The kLanes scores q . k_i (unscaled) of query q against the keys k[0..kLanes).
TW_TARGET inline Vec Scores(const float* q, const float* const* k, int64_t dv) {
  Vec part[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    Vec acc = Mul(Load(q), Load(k[i]));
    for (int64_t c = 1; c < dv; ++c) acc = Fma(Load(q + c * kLanes), Load(k[i] + c * kLanes), acc);
    part[i] = acc;
  }
  return HSums(part);
}

// Fetch the cache lines of rows [from, to) of a [n, d] array into L1, those before n only.
TW_TARGET inline void FetchRows(const float* rows, int64_t d, int64_t from, int64_t to, int64_t n) {
  if (from >= n) return;
  const char* line = reinterpret_cast<const char*>(rows + from * d);
  const char* end = reinterpret_cast<const char*>(rows + std::min(to, n) * d);
  for (; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
}

// o[g][cols] = sum_{a < n} p[g][a] * v[a][cols] for NG heads (p rows np apart, o rows d apart) and
// NC vectors of columns (v and o point at the first column; v rows are d apart). The rows `ahead`
// keys on are fetched along the way (the columns this pass reads; none past n).
template <int NG, int NC>
TW_TARGET inline void Values(const float* p, int64_t np, const float* v, int64_t d, int64_t n, float* o, int64_t ahead) {
  Vec acc[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NC; ++j) acc[g][j] = Zero();
  for (int64_t a = 0; a < n; ++a) {
    if (a + ahead < n) {
      constexpr int kVecsPerLine = 64 / static_cast<int>(sizeof(float) * kLanes);  // 1 (AVX-512) or 2 (AVX2)
      for (int j = 0; j < NC; j += kVecsPerLine)
        _mm_prefetch(reinterpret_cast<const char*>(v + (a + ahead) * d + j * kLanes), _MM_HINT_T0);
    }
    Vec x[NC];
    for (int j = 0; j < NC; ++j) x[j] = Load(v + a * d + j * kLanes);
    for (int g = 0; g < NG; ++g) {
      const Vec w = Bcast(p + g * np + a);
      for (int j = 0; j < NC; ++j) acc[g][j] = Fma(w, x[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NC; ++j) Store(o + g * d + j * kLanes, acc[g][j]);
}

template <int NG>
TW_TARGET void ValuesOf(int64_t nc, const float* p, int64_t np, const float* v, int64_t d, int64_t n, float* o,
                        int64_t ahead) {
  static_assert(kValueVecs == 4, "the cases below go up to 4 column vectors");
  switch (nc) {
    case 4: return Values<NG, 4>(p, np, v, d, n, o, ahead);
    case 3: return Values<NG, 3>(p, np, v, d, n, o, ahead);
    case 2: return Values<NG, 2>(p, np, v, d, n, o, ahead);
    default: return Values<NG, 1>(p, np, v, d, n, o, ahead);
  }
}

// One (row, kv head) unit: keys/values [n, D] of the slot's kv head, queries qh [G, D], out oh [G, D].
TW_TARGET void Unit(const float* qh, const float* keys, const float* values, int64_t n, int64_t g_count, int64_t d,
                    float* oh, std::vector<float>& scores) {
  const int64_t dv = d / kLanes, np = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(static_cast<size_t>(g_count * np));
  const Vec scale = Set1(1.0f / std::sqrt(static_cast<float>(d)));
  const int64_t ahead = std::max<int64_t>(1, kAheadBytes / (d * static_cast<int64_t>(sizeof(float))));  // rows
  // Scores, kLanes keys at a time; a group running past n repeats key n - 1 (so nothing past it is
  // read), and those lanes are set to -inf below. The keys `ahead` rows on are fetched meanwhile.
  for (int64_t a0 = 0; a0 < n; a0 += kLanes) {
    FetchRows(keys, d, a0 + ahead, a0 + ahead + kLanes, n);
    const float* k[kLanes];
    for (int i = 0; i < kLanes; ++i) k[i] = keys + std::min<int64_t>(a0 + i, n - 1) * d;
    for (int64_t g = 0; g < g_count; ++g) Store(&scores[g * np + a0], Mul(Scores(qh + g * d, k, dv), scale));
  }
  FetchRows(values, d, 0, ahead, n);  // the first values, while the softmax runs
  // Softmax of each head's scores, normalised in place (the padding lanes: e^-inf = 0).
  for (int64_t g = 0; g < g_count; ++g) {
    float* p = &scores[g * np];
    for (int64_t a = n; a < np; ++a) p[a] = tokenwire::vec::kNegInf;
    Vec m = Load(p);
    for (int64_t a0 = kLanes; a0 < np; a0 += kLanes) m = Max(m, Load(p + a0));
    const Vec top = Set1(HMax(m));
    Vec sum = Zero();
    for (int64_t a0 = 0; a0 < np; a0 += kLanes) {
      const Vec e = Exp(Sub(Load(p + a0), top));
      Store(p + a0, e);
      sum = Add(sum, e);
    }
    const Vec inv = Set1(1.0f / HSum(sum));
    for (int64_t a0 = 0; a0 < np; a0 += kLanes) Store(p + a0, Mul(Load(p + a0), inv));
  }
  // P . V, kValueHeads heads and kValueVecs column vectors a pass.
  for (int64_t g0 = 0; g0 < g_count; g0 += kValueHeads) {
    const int64_t ng = std::min<int64_t>(kValueHeads, g_count - g0);
    for (int64_t c = 0; c < dv; c += kValueVecs) {
      const int64_t nc = std::min<int64_t>(kValueVecs, dv - c);
      const float* p = &scores[g0 * np];
      const float* v = values + c * kLanes;
      float* o = oh + g0 * d + c * kLanes;
      if (ng >= 3) {
        ValuesOf<3>(nc, p, np, v, d, n, o, ahead);
      } else if (ng == 2) {
        ValuesOf<2>(nc, p, np, v, d, n, o, ahead);
      } else {
        ValuesOf<1>(nc, p, np, v, d, n, o, ahead);
      }
    }
  }
}
