// decode_attention.cpp's body, included once per instruction set: in each namespace `S` is that set's vectors
// (Scalar, Avx2 or Avx512) and a `#pragma GCC target` around the include compiles it for those instructions.
// Not a header of its own: it has no include guard on purpose.

using V = S::V;

// s [heads, n] = q [heads, d] (scaled) . each dense key (channels innermost); d a multiple of S::W. Four heads
// at a time share each load of a key and one horizontal sum (a missing fourth head: a zero query's).
template <typename T>
INLINE void dense_scores(const float* q, int64_t heads, int64_t d, const Part& k, int64_t n, float* s) {
  const T* codes = static_cast<const T*>(k.codes);
  std::vector<float> padded(4 * d, 0.f);
  for (int64_t h0 = 0; h0 < heads; h0 += 4) {
    const int64_t hs = std::min<int64_t>(4, heads - h0);
    std::copy(q + h0 * d, q + (h0 + hs) * d, padded.begin());
    std::fill(padded.begin() + hs * d, padded.end(), 0.f);
    const float* q4 = padded.data();
    for (int64_t t = 0; t < n; ++t) {
      const T* key = codes + t * k.token_stride;
      prefetch_row(key + AHEAD * k.token_stride, d * sizeof(T));
      V a = S::zero(), b = S::zero(), c4 = S::zero(), e = S::zero();
      for (int64_t c = 0; c < d; c += S::W) {
        const V kc = S::load(key + c);
        a = S::fma(S::load(q4 + c), kc, a);
        b = S::fma(S::load(q4 + d + c), kc, b);
        c4 = S::fma(S::load(q4 + 2 * d + c), kc, c4);
        e = S::fma(S::load(q4 + 3 * d + c), kc, e);
      }
      float sums[4];
      S::sum4(a, b, c4, e, sums);
      for (int64_t h = 0; h < hs; ++h) s[(h0 + h) * n + t] = sums[h];
    }
  }
}

// f(std::integral_constant<int, HS>{}) for HS = min(count, 8): a head count known when compiled, so that a pass's
// HS sums stay in registers.
template <typename F>
INLINE void with_heads(int64_t count, F&& f) {
  switch (std::min<int64_t>(count, 8)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// One block of W tokens' scores over 8-bit keys kept tokens innermost, for HS heads (a count known when compiled,
// so that the sums stay in registers): each channel's codes times their group's scales (exact in fp32: 8 bits times
// fp16's 11), the key as the torch version dequantizes it, then a multiply-add per head. Widened and scaled once
// for all HS heads, with HS sums in registers (not HS partial sums beside them), so a whole GQA group of up to 8
// heads is one pass on AVX2 too: each code is read and widened once, not twice for Qwen2.5's 6 to 8 heads.
template <int HS>
INLINE void int8_block(const float* q, int64_t d, const Part& k, int64_t groups, int64_t t0, int64_t n, float* s) {
  const int8_t* codes = static_cast<const int8_t*>(k.codes);
  V acc[HS];
  for (int h = 0; h < HS; ++h) acc[h] = S::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const V scale = S::load(k.scales + g * k.scale_channel_stride + t0);
    for (int64_t c = g * k.group; c < (g + 1) * k.group; ++c) {
      const V kc = S::mul(S::load(codes + c * k.channel_stride + t0), scale);
      for (int h = 0; h < HS; ++h) acc[h] = S::fma(S::set1(q[h * d + c]), kc, acc[h]);
    }
  }
  for (int h = 0; h < HS; ++h) S::store(s + h * n + t0, acc[h]);
}

// s [heads, n] = q [heads, d] (scaled) . each 8-bit key, W tokens at a time, then the last few one at a time.
INLINE void int8_scores(const float* q, int64_t heads, int64_t d, const Part& k, int64_t n, float* s) {
  const int64_t groups = d / k.group;
  int64_t t0 = 0;
  const int8_t* all = static_cast<const int8_t*>(k.codes);
  for (; t0 + S::W <= n; t0 += S::W) {
    // Each channel's (and group's) tokens are a row of their own, d rows read side by side: more streams than the
    // hardware prefetcher follows, so each row's next lines are asked for ahead (from DRAM, a long cache ran at
    // half the speed of a short one without it).
    if (t0 % 64 == 0 && t0 + PREFETCH_TOKENS < n) {
      for (int64_t c = 0; c < d; ++c) __builtin_prefetch(all + c * k.channel_stride + t0 + PREFETCH_TOKENS);
      for (int64_t g = 0; g < groups; ++g) {
        __builtin_prefetch(k.scales + g * k.scale_channel_stride + t0 + PREFETCH_TOKENS);
        __builtin_prefetch(k.scales + g * k.scale_channel_stride + t0 + PREFETCH_TOKENS + 32);
      }
    }
    for (int64_t h0 = 0; h0 < heads; h0 += 8) {  // 8 heads' sums, the codes and their scale: AVX2's 16 registers
      const float* qh = q + h0 * d;
      float* sh = s + h0 * n;
      with_heads(heads - h0, [&](auto hs) { int8_block<decltype(hs)::value>(qh, d, k, groups, t0, n, sh); });
    }
  }
  const int8_t* codes = static_cast<const int8_t*>(k.codes);
  for (int64_t t = t0; t < n; ++t) {  // the last tokens, one at a time, each key dequantized as above
    for (int64_t h = 0; h < heads; ++h) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = S::half(k.scales + g * k.scale_channel_stride + t);
        for (int64_t c = g * k.group; c < (g + 1) * k.group; ++c)
          total = Scalar::fma(q[h * d + c], Scalar::load(codes + c * k.channel_stride + t) * scale, total);
      }
      s[h * n + t] = total;
    }
  }
}

// out [HS, dv] columns c0.. (COLS vectors) = sum over tokens of p[h, t] x value t, dense or 8-bit, the sums in
// registers (HS and COLS known when compiled).
template <typename T, int HS, int COLS>
INLINE void value_block(const float* p, int64_t n, const Part& v, int64_t c0, int64_t dv, float* out) {
  const T* codes = static_cast<const T*>(v.codes);
  V acc[HS][COLS], row[COLS];
  for (int h = 0; h < HS; ++h)
    for (int j = 0; j < COLS; ++j) acc[h][j] = S::zero();
  for (int64_t t = 0; t < n; ++t) {
    const T* value = codes + t * v.token_stride + c0;
    prefetch_row(value + AHEAD * v.token_stride, COLS * S::W * sizeof(T));
    for (int j = 0; j < COLS; ++j) row[j] = S::load(value + j * S::W);
    if (v.scales != nullptr) {
      const at::Half* scales = v.scales + t * v.scale_token_stride;
      int64_t group = -1;
      V scale = S::zero();
      for (int j = 0; j < COLS; ++j) {  // a scale covers whole vectors (groups of 32 channels, or the head)
        if ((c0 + j * S::W) / v.group != group) {
          group = (c0 + j * S::W) / v.group;
          scale = S::set1(S::half(scales + group * v.scale_channel_stride));
        }
        row[j] = S::mul(row[j], scale);
      }
    }
    for (int h = 0; h < HS; ++h) {
      const V w = S::set1(p[h * n + t]);
      for (int j = 0; j < COLS; ++j) acc[h][j] = S::fma(w, row[j], acc[h][j]);
    }
  }
  for (int h = 0; h < HS; ++h)
    for (int j = 0; j < COLS; ++j) S::store(out + h * dv + c0 + j * S::W, acc[h][j]);
}

template <typename T, int COLS>
INLINE void value_columns(const float* p, int64_t heads, int64_t n, const Part& v, int64_t c0, int64_t dv,
                          float* out) {
  for (int64_t h0 = 0; h0 < heads; h0 += S::HEADS) {
    const float* ph = p + h0 * n;
    float* oh = out + h0 * dv;
    switch (std::min(S::HEADS, heads - h0)) {
      case 1: value_block<T, 1, COLS>(ph, n, v, c0, dv, oh); break;
      case 2: value_block<T, 2, COLS>(ph, n, v, c0, dv, oh); break;
      case 3: value_block<T, 3, COLS>(ph, n, v, c0, dv, oh); break;
      default: value_block<T, 4, COLS>(ph, n, v, c0, dv, oh); break;
    }
  }
}

// out [HS, dv] for HS heads of an 8-bit cache: their columns S::value_cols(HS) vectors at a time (as many as the
// registers hold beside HS heads' sums), then one at a time.
template <int HS>
INLINE void int8_values(const float* p, int64_t n, const Part& v, int64_t dv, float* out) {
  constexpr int COLS = S::value_cols(HS);
  int64_t c0 = 0;
  for (; c0 + COLS * S::W <= dv; c0 += COLS * S::W) value_block<int8_t, HS, COLS>(p, n, v, c0, dv, out);
  for (; c0 < dv; c0 += S::W) value_block<int8_t, HS, 1>(p, n, v, c0, dv, out);
}

// out [heads, dv] = sum over tokens of p[h, t] x value t (channels innermost); dv a multiple of S::W.
// Dense values: 4 vectors of columns at a time, S::HEADS heads a pass over the tokens, the head passes of one block of
// columns one after the other (the second reads the rows' lines the first left in cache).
// 8-bit values: up to 8 heads a pass (a whole GQA group of Qwen2.5's 6 to 8 query heads), since each code is widened
// and scaled once for all the heads of a pass. Timed on a Zen 3 (AVX2, 2 threads, 4,096 tokens of context, every
// layer of the 0.5B to 7B shapes, medians of 9 alternated with the old build): the 8-bit cache's attention 14-19%
// less a step than in the dense layout; dense values measured no faster in this one (up to 10% slower: the second
// pass of a block of columns then reads from further out), so they keep theirs. The same bits either way.
template <typename T>
INLINE void weighted_values(const float* p, int64_t heads, int64_t n, const Part& v, int64_t dv, float* out) {
  if constexpr (std::is_same_v<T, int8_t>) {
    for (int64_t h0 = 0; h0 < heads; h0 += 8) {
      const float* ph = p + h0 * n;
      float* oh = out + h0 * dv;
      with_heads(heads - h0, [&](auto hs) { int8_values<decltype(hs)::value>(ph, n, v, dv, oh); });
    }
  } else {
    int64_t c0 = 0;
    for (; c0 + 4 * S::W <= dv; c0 += 4 * S::W) value_columns<T, 4>(p, heads, n, v, c0, dv, out);
    for (; c0 < dv; c0 += S::W) value_columns<T, 1>(p, heads, n, v, c0, dv, out);
  }
}

// Each head's row of s [heads, n] -> its softmax, in place.
INLINE void softmax_rows(float* s, int64_t heads, int64_t n) {
  const int64_t whole = n / S::W * S::W;
  for (int64_t h = 0; h < heads; ++h) {
    float* row = s + h * n;
    V top_v = S::set1(-INFINITY);
    for (int64_t t = 0; t < whole; t += S::W) top_v = S::max(top_v, S::load(row + t));
    float top = S::top(top_v);
    for (int64_t t = whole; t < n; ++t) top = std::max(top, row[t]);
    V total_v = S::zero();
    for (int64_t t = 0; t < whole; t += S::W) {
      const V e = S::exp(S::add(S::load(row + t), S::set1(-top)));
      S::store(row + t, e);
      total_v = S::add(total_v, e);
    }
    float total = S::sum(total_v);
    for (int64_t t = whole; t < n; ++t) {
      row[t] = Scalar::exp(row[t] - top);
      total += row[t];
    }
    const V inv = S::set1(1.f / total);
    for (int64_t t = 0; t < whole; t += S::W) S::store(row + t, S::mul(S::load(row + t), inv));
    for (int64_t t = whole; t < n; ++t) row[t] *= 1.f / total;
  }
}

// One work item: `heads` query rows q [heads, d] against one KV head's n keys and values -> out [heads, dv].
template <typename K>
INLINE void attend_body(const float* q, int64_t heads, int64_t d, int64_t dv, const Part& k, const Part& v,
                        int64_t n, float scaling, float* out) {
  std::vector<float> s(heads * n), qs(heads * d);
  for (int64_t i = 0; i < heads * d; ++i) qs[i] = q[i] * scaling;
  if (k.scales != nullptr)
    int8_scores(qs.data(), heads, d, k, n, s.data());
  else
    dense_scores<K>(qs.data(), heads, d, k, n, s.data());
  softmax_rows(s.data(), heads, n);
  weighted_values<K>(s.data(), heads, n, v, dv, out);
}

template <typename K>
void attend(const float* q, int64_t heads, int64_t d, int64_t dv, const Part& k, const Part& v, int64_t n,
            float scaling, float* out) {
  attend_body<K>(q, heads, d, dv, k, v, n, scaling, out);
}
