// The ISA-generic body of decode_attention.cc: one work unit (a row and a kv head: the G query heads
// that share the row's keys), written once and included there twice, for AVX2 and for AVX-512,
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
// Keys and values are read in place from the pools' pages (Pages: the row's pages of its kv head,
// in position order), only positions 0..n-1. The walk goes page by page, so a key's address needs
// no division; the rows fetched ahead are those at the same offset `ahead` pages on (into L1) and
// `far` pages on (into L2), whose addresses the table gives like any other's
// (decode_attention.cc, kAheadBytes, says why both).

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

// Fetch the cache lines of `count` consecutive values: into L1 (Hint _MM_HINT_T0) or L2 (_MM_HINT_T1).
template <_mm_hint Hint>
TW_TARGET inline void Fetch(const float* values, int64_t count) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(values + count);
  for (uintptr_t line = reinterpret_cast<uintptr_t>(values) & ~uintptr_t{63}; line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), Hint);
}

// Fetch `count` rows from offset `off` of the page `step` pages after page pg (where key a is, at
// offset off), those of them before key n.
template <_mm_hint Hint>
TW_TARGET inline void FetchAhead(const Pages& pages, int64_t pg, int64_t off, int64_t a, int64_t count, int64_t step,
                                 int64_t d, int64_t n) {
  const int64_t rows = std::min(count, n - a - step * pages.size);
  if (rows > 0) Fetch<Hint>(pages.page[pg + step] + off * d, rows * d);
}

// o[g][cols] = sum_{a < n} p[g][a] * v[a][cols] for NG heads (p rows np apart, o rows d apart) and
// NC vectors of columns from `col` on (value rows are d apart within a page). Along with row i of
// a page, row i of the page v.ahead pages on is fetched into L1 and of the one v.far on into L2
// (the columns this pass reads; none past n).
template <int NG, int NC>
TW_TARGET inline void Values(const float* p, int64_t np, const Pages& v, int64_t col, int64_t d, int64_t n, float* o) {
  constexpr int kVecsPerLine = 64 / static_cast<int>(sizeof(float) * kLanes);  // 1 (AVX-512) or 2 (AVX2)
  Vec acc[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NC; ++j) acc[g][j] = Zero();
  for (int64_t pg = 0, a0 = 0; a0 < n; ++pg, a0 += v.size) {
    const float* rows = v.page[pg] + col;
    const int64_t count = std::min(v.size, n - a0);
    const int64_t near = std::min(count, n - a0 - v.ahead * v.size), far = std::min(count, n - a0 - v.far * v.size);
    const float* near_rows = near > 0 ? v.page[pg + v.ahead] + col : rows;
    const float* far_rows = far > 0 ? v.page[pg + v.far] + col : rows;
    for (int64_t i = 0; i < count; ++i) {
      for (int j = 0; j < NC; j += kVecsPerLine) {
        if (i < near) _mm_prefetch(reinterpret_cast<const char*>(near_rows + i * d + j * kLanes), _MM_HINT_T0);
        if (i < far) _mm_prefetch(reinterpret_cast<const char*>(far_rows + i * d + j * kLanes), _MM_HINT_T1);
      }
      Vec x[NC];
      for (int j = 0; j < NC; ++j) x[j] = Load(rows + i * d + j * kLanes);
      for (int g = 0; g < NG; ++g) {
        const Vec w = Bcast(p + g * np + a0 + i);
        for (int j = 0; j < NC; ++j) acc[g][j] = Fma(w, x[j], acc[g][j]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < NC; ++j) Store(o + g * d + j * kLanes, acc[g][j]);
}

template <int NG>
TW_TARGET void ValuesOf(int64_t nc, const float* p, int64_t np, const Pages& v, int64_t col, int64_t d, int64_t n,
                        float* o) {
  static_assert(kValueVecs == 4, "the cases below go up to 4 column vectors");
  switch (nc) {
    case 4: return Values<NG, 4>(p, np, v, col, d, n, o);
    case 3: return Values<NG, 3>(p, np, v, col, d, n, o);
    case 2: return Values<NG, 2>(p, np, v, col, d, n, o);
    default: return Values<NG, 1>(p, np, v, col, d, n, o);
  }
}

// The scores of keys [0, n) against the G queries qh [G, D], scaled, into scores [G][np]; kLanes keys
// at a time. A group running past n repeats key n - 1 (so nothing past it is read); Unit sets
// those lanes to -inf. Along with each key, its row keys.ahead pages on is fetched into L1 and its
// row keys.far pages on into L2.
TW_TARGET void AllScores(const float* qh, const Pages& keys, int64_t n, int64_t g_count, int64_t d, int64_t np,
                         float* scores) {
  const int64_t dv = d / kLanes;
  const Vec scale = Set1(1.0f / std::sqrt(static_cast<float>(d)));
  int64_t pg = 0, off = 0;  // the page and offset of key a0
  for (int64_t a0 = 0; a0 < n; a0 += kLanes) {
    const float* k[kLanes];
    if (a0 + kLanes <= n && off + kLanes <= keys.size) {  // a group in one page (P a multiple of kLanes)
      const float* row = keys.page[pg] + off * d;
      for (int i = 0; i < kLanes; ++i) k[i] = row + i * d;
      FetchAhead<_MM_HINT_T0>(keys, pg, off, a0, kLanes, keys.ahead, d, n);
      FetchAhead<_MM_HINT_T1>(keys, pg, off, a0, kLanes, keys.far, d, n);
      off += kLanes;
    } else {  // a group across pages (P < kLanes), or the last one
      for (int i = 0; i < kLanes; ++i) {
        if (a0 + i >= n) {
          k[i] = k[i - 1];  // i >= 1: a0 < n
          continue;
        }
        k[i] = keys.page[pg] + off * d;
        FetchAhead<_MM_HINT_T0>(keys, pg, off, a0 + i, 1, keys.ahead, d, n);
        FetchAhead<_MM_HINT_T1>(keys, pg, off, a0 + i, 1, keys.far, d, n);
        if (++off == keys.size) {
          off = 0;
          ++pg;
        }
      }
    }
    if (off == keys.size) {
      off = 0;
      ++pg;
    }
    for (int64_t g = 0; g < g_count; ++g) Store(&scores[g * np + a0], Mul(Scores(qh + g * d, k, dv), scale));
  }
}

// One (row, kv head) unit: the row's keys and values of its kv head through their pages, n of
// them, the first `skip` (< P: before a sliding window, in the first page read) masked out;
// the scores soft-capped when softcap > 0 (CapScores); sinks [G] (nullptr: none): each head's
// sink logit joins its softmax's denominator, with no value (gpt-oss); queries qh [G, D], out oh [G, D].
TW_TARGET void Unit(const float* qh, const Pages& keys, const Pages& values, int64_t n, int64_t skip, int64_t g_count,
                    int64_t d, float softcap, const float* sinks, float* oh, std::vector<float>& scores) {
  const int64_t dv = d / kLanes, np = (n + kLanes - 1) / kLanes * kLanes;
  scores.resize(static_cast<size_t>(g_count * np));
  // The first line of every page the unit reads, so that reaching each page (anywhere in the
  // pool) starts now and overlaps with the others, instead of one page at a time as the walk gets
  // there (decode_attention.cc, kAheadBytes, has the figures); then the first keys, which nothing
  // fetches ahead of.
  for (int64_t i = 0; i < (n + keys.size - 1) / keys.size; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(keys.page[i]), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(values.page[i]), _MM_HINT_T0);
  }
  const int64_t ahead_rows = keys.ahead * keys.size;
  for (int64_t pg = 0; pg * keys.size < std::min(n, ahead_rows); ++pg)
    Fetch<_MM_HINT_T0>(keys.page[pg], std::min(keys.size, n - pg * keys.size) * d);
  AllScores(qh, keys, n, g_count, d, np, scores.data());
  if (softcap > 0.0f) CapScores(scores.data(), g_count, np, 0, n, softcap);
  // The first values, while the softmax runs.
  for (int64_t pg = 0; pg * values.size < std::min(n, ahead_rows); ++pg)
    Fetch<_MM_HINT_T0>(values.page[pg], std::min(values.size, n - pg * values.size) * d);
  // Softmax of each head's scores, normalised in place (the padding lanes and the skipped keys: e^-inf = 0).
  for (int64_t g = 0; g < g_count; ++g) {
    float* p = &scores[g * np];
    for (int64_t a = 0; a < skip; ++a) p[a] = tokenwire::vec::kNegInf;
    for (int64_t a = n; a < np; ++a) p[a] = tokenwire::vec::kNegInf;
    Vec m = Load(p);
    for (int64_t a0 = kLanes; a0 < np; a0 += kLanes) m = Max(m, Load(p + a0));
    const float head_top = sinks != nullptr ? std::max(HMax(m), sinks[g]) : HMax(m);
    const Vec top = Set1(head_top);
    Vec sum = Zero();
    for (int64_t a0 = 0; a0 < np; a0 += kLanes) {
      const Vec e = Exp(Sub(Load(p + a0), top));
      Store(p + a0, e);
      sum = Add(sum, e);
    }
    const float total = HSum(sum) + (sinks != nullptr ? std::exp(sinks[g] - head_top) : 0.0f);
    const Vec inv = Set1(1.0f / total);
    for (int64_t a0 = 0; a0 < np; a0 += kLanes) Store(p + a0, Mul(Load(p + a0), inv));
  }
  // P . V, kValueHeads heads and kValueVecs column vectors a pass.
  for (int64_t g0 = 0; g0 < g_count; g0 += kValueHeads) {
    const int64_t ng = std::min<int64_t>(kValueHeads, g_count - g0);
    for (int64_t c = 0; c < dv; c += kValueVecs) {
      const int64_t nc = std::min<int64_t>(kValueVecs, dv - c);
      const float* p = &scores[g0 * np];
      float* o = oh + g0 * d + c * kLanes;
      if (ng >= 3) {
        ValuesOf<3>(nc, p, np, values, c * kLanes, d, n, o);
      } else if (ng == 2) {
        ValuesOf<2>(nc, p, np, values, c * kLanes, d, n, o);
      } else {
        ValuesOf<1>(nc, p, np, values, c * kLanes, d, n, o);
      }
    }
  }
}
