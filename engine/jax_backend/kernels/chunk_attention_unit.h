// The ISA-generic body of chunk_attention.cc: one work unit (a kv head and a tile of chunk
// positions), written once and included there twice, for AVX2 and for AVX-512, each inside its own
// namespace, which brings in that width's primitives (vec.h: Vec, kLanes, Load, Fma, Exp, MaskPast,
// ...) and defines kKeys (keys per score micro-tile), kCols (value columns per P . V micro-tile),
// kTile and TW_TARGET (the function attribute that enables the ISA). Deliberately no include guard.
//
// Layout: the unit's rows (row r = ci * G + g for chunk position c0 + ci and query head kv * G + g)
// lie in vector lanes, padded to R, a multiple of kLanes. Queries are transposed once per unit to
// qt [D][R]; scores and probabilities are st [block][R]; the output is accumulated transposed, ot
// [D][R]. So both products are outer-product micro-kernels (a vector of rows times a broadcast
// scalar of a key or value row, read in place from the pools' pages), and the softmax statistics
// (max, sum, rescale) are vertical: no horizontal reduction and no transpose of K or V anywhere.
// A key block's rows are found through the table once per block (key_rows, value_rows: a pointer
// a key), so the micro-kernels index keys, not pages. Those arrays live on the stack: in the
// thread_local Scratch, the compiler specialised Values on their address and looked the thread's
// storage up (__tls_get_addr, spilling every accumulator around it) once per key, which made the
// whole kernel ~1.7x slower.

// st[i][rows] = sum_e qt[e][rows] * k_i[e] for kKeys keys and NV vectors of rows (rows r_stride apart).
template <int NV>
TW_TARGET inline void Scores(const float* qt, int64_t r_stride, const float* const* k, int64_t d, float* st) {
  Vec acc[kKeys][NV];
  for (int i = 0; i < kKeys; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Zero();
  for (int64_t e = 0; e < d; ++e) {
    Vec x[NV];
    for (int j = 0; j < NV; ++j) x[j] = Load(qt + e * r_stride + kLanes * j);
    for (int i = 0; i < kKeys; ++i) {
      const Vec y = Bcast(k[i] + e);
      for (int j = 0; j < NV; ++j) acc[i][j] = Fma(x[j], y, acc[i][j]);
    }
  }
  for (int i = 0; i < kKeys; ++i)
    for (int j = 0; j < NV; ++j) Store(st + i * r_stride + kLanes * j, acc[i][j]);
}

// ot[c][rows] += sum_{a < n} v[a][col + c] * pt[a][rows] for kCols columns c (v[a]: value row a).
template <int NV>
TW_TARGET inline void Values(const float* pt, int64_t r_stride, const float* const* v, int64_t col, int64_t n, float* ot) {
  Vec acc[kCols][NV];
  for (int i = 0; i < kCols; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Zero();
  for (int64_t a = 0; a < n; ++a) {
    Vec x[NV];
    for (int j = 0; j < NV; ++j) x[j] = Load(pt + a * r_stride + kLanes * j);
    const float* row = v[a] + col;
    for (int i = 0; i < kCols; ++i) {
      const Vec y = Bcast(row + i);
      for (int j = 0; j < NV; ++j) acc[i][j] = Fma(x[j], y, acc[i][j]);
    }
  }
  for (int i = 0; i < kCols; ++i)
    for (int j = 0; j < NV; ++j) {
      float* o = ot + i * r_stride + kLanes * j;
      Store(o, Add(Load(o), acc[i][j]));
    }
}

// One unit: kv head `kv`, chunk positions [c0, c1), keys/values that kv head's pages of the table
// (key_pages[i] holds positions [i * P, (i + 1) * P)),
// split `split` of `splits` of the tile's keys (block-aligned ranges; a row sees only its causal
// part of its range). With one split the unit writes its rows' outputs into `out`; with several
// it writes each row's partial softmax to `part` ([rows] max, [rows] sum, [rows][D] unnormalised
// output, ChunkAttention merges them). Padding rows copy row 0's limit and have zero queries; they
// are never written out.
TW_TARGET void Unit(const Shape& s, const float* q, const float* const* key_pages, const float* const* value_pages,
                    int64_t start, float* out,
                    int64_t kv, int64_t c0, int64_t c1, int64_t split, int64_t splits, float* part, Scratch& w) {
  const int64_t d = s.dim, g_count = s.group;
  const int64_t rows = (c1 - c0) * g_count, nv = (rows + kLanes - 1) / kLanes, rr = nv * kLanes;
  w.qt.assign(static_cast<size_t>(d * rr), 0.0f);
  w.ot.assign(static_cast<size_t>(d * rr), 0.0f);
  w.st.resize(static_cast<size_t>(kKeyBlock * rr));
  w.m.assign(static_cast<size_t>(rr), kNegInf);
  w.l.assign(static_cast<size_t>(rr), 0.0f);
  w.last.assign(static_cast<size_t>(rr), static_cast<int32_t>(std::min(start + c0, s.context - 1)));
  w.from.assign(static_cast<size_t>(rr), static_cast<int32_t>(FirstSeen(s, w.last[0])));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t ci = 0; ci < c1 - c0; ++ci) {
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t r = ci * g_count + g;
      const float* src = q + ((c0 + ci) * s.heads + kv * g_count + g) * d;
      for (int64_t e = 0; e < d; ++e) w.qt[e * rr + r] = src[e] * scale;
      w.last[r] = static_cast<int32_t>(std::min(start + c0 + ci, s.context - 1));
      w.from[r] = static_cast<int32_t>(FirstSeen(s, w.last[r]));
    }
  }
  const int64_t first = w.last[0], n_keys = w.last[rows - 1] + 1;  // every row sees keys <= first
  // A sliding window: no row sees a key before w.from[0], so the walk starts at its block, and only
  // keys before w.from[rows - 1] can be before some row's window.
  const int64_t skip_to = w.from[rows - 1], lead = w.from[0] / kKeyBlock;
  const int64_t n_blocks = (n_keys + kKeyBlock - 1) / kKeyBlock - lead;
  const int64_t b0 = lead + n_blocks * split / splits, b1 = lead + n_blocks * (split + 1) / splits;
  const Vec neg_inf = Set1(kNegInf);
  const float* key_rows[kKeyBlock];    // the current block's key rows, through the table
  const float* value_rows[kKeyBlock];  // and its value rows

  const int64_t end = std::min(n_keys, b1 * kKeyBlock);  // this unit's keys: [b0 * kKeyBlock, end)
  for (int64_t a0 = b0 * kKeyBlock; a0 < end; a0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, n_keys - a0);
    for (int64_t a = 0; a < nb; ++a) {
      const int64_t at = (a0 + a) % s.page_size * d, page = (a0 + a) / s.page_size;
      key_rows[a] = key_pages[page] + at;
      value_rows[a] = value_pages[page] + at;
    }
    // Scores, kKeys keys at a time; a group running past nb repeats the block's last key (those
    // scores are never used), so nothing past the chunk's end is read.
    for (int64_t a = 0; a < nb; a += kKeys) {
      const float* k[kKeys];
      for (int i = 0; i < kKeys; ++i) k[i] = key_rows[std::min<int64_t>(a + i, nb - 1)];
      int64_t j = 0;
      for (; j + 3 <= nv; j += 3) Scores<3>(&w.qt[kLanes * j], rr, k, d, &w.st[a * rr + kLanes * j]);
      if (nv - j == 2) Scores<2>(&w.qt[kLanes * j], rr, k, d, &w.st[a * rr + kLanes * j]);
      if (nv - j == 1) Scores<1>(&w.qt[kLanes * j], rr, k, d, &w.st[a * rr + kLanes * j]);
    }
    // Gemma 2's soft-cap, before any mask (a masked score becomes -inf after it).
    if (s.softcap > 0.0f) {
      const float inv = 1.0f / s.softcap;
      for (int64_t i = 0; i < nb * rr; ++i) w.st[i] = s.softcap * std::tanh(w.st[i] * inv);
    }
    // Keys before a row's window (a scalar walk: at most a tile's span of keys per unit).
    for (int64_t a = 0; a < std::min(nb, skip_to - a0); ++a) {
      for (int64_t r = 0; r < rr; ++r) {
        if (a0 + a < w.from[r]) w.st[a * rr + r] = kNegInf;
      }
    }
    // Online softmax, a vector of rows at a time: mask keys past each row's position (only keys
    // past `first` can be), then rescale what the rows have so far by e^(old max - new max).
    for (int64_t j = 0; j < nv; ++j) {
      const int32_t* last = &w.last[kLanes * j];
      Vec vmax = neg_inf;
      for (int64_t a = 0; a < nb; ++a) {
        float* p = &w.st[a * rr + kLanes * j];
        Vec x = Load(p);
        if (a0 + a > first) {
          x = MaskPast(x, last, static_cast<int32_t>(a0 + a));
          Store(p, x);
        }
        vmax = Max(vmax, x);
      }
      const Vec m_old = Load(&w.m[kLanes * j]);
      // A row that has seen no key yet (m_new = -inf: a split past its position, or blocks before
      // its window) gets e^NaN = 0
      // for its probabilities and its correction, so it keeps max -inf, sum 0 and output 0.
      const Vec m_new = Max(m_old, vmax);
      const Vec corr = Exp(Sub(m_old, m_new));  // 0 on the row's first seen block (m_old = -inf)
      Vec sum = Zero();
      for (int64_t a = 0; a < nb; ++a) {
        float* p = &w.st[a * rr + kLanes * j];
        const Vec e = Exp(Sub(Load(p), m_new));
        Store(p, e);
        sum = Add(sum, e);
      }
      Store(&w.l[kLanes * j], Fma(Load(&w.l[kLanes * j]), corr, sum));
      Store(&w.m[kLanes * j], m_new);
      if (a0 > b0 * kKeyBlock) {
        for (int64_t e = 0; e < d; ++e) {
          float* o = &w.ot[e * rr + kLanes * j];
          Store(o, Mul(Load(o), corr));
        }
      }
    }
    // ot += P . V over the block's keys, kCols value columns at a time.
    for (int64_t c = 0; c < d; c += kCols) {
      int64_t j = 0;
      for (; j + 3 <= nv; j += 3) Values<3>(&w.st[kLanes * j], rr, value_rows, c, nb, &w.ot[c * rr + kLanes * j]);
      if (nv - j == 2) Values<2>(&w.st[kLanes * j], rr, value_rows, c, nb, &w.ot[c * rr + kLanes * j]);
      if (nv - j == 1) Values<1>(&w.st[kLanes * j], rr, value_rows, c, nb, &w.ot[c * rr + kLanes * j]);
    }
  }
  if (splits > 1) {
    for (int64_t r = 0; r < rows; ++r) {
      part[r] = w.m[r];
      part[rows + r] = w.l[r];
      for (int64_t e = 0; e < d; ++e) part[2 * rows + r * d + e] = w.ot[e * rr + r];
    }
    return;
  }
  for (int64_t ci = 0; ci < c1 - c0; ++ci) {
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t r = ci * g_count + g;
      const float inv = 1.0f / (w.l[r] + SinkTerm(s, kv * g_count + g, w.m[r]));  // (0 without sinks)
      float* dst = out + ((c0 + ci) * s.heads + kv * g_count + g) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = w.ot[e * rr + r] * inv;
    }
  }
}
