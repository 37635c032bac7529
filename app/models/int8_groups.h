// A GGUF's 5- to 8-bit blocks on the int4 kernel's arithmetic (included by int4_decode.cpp, whose activations,
// quantized per block of 32 to int8, it shares): y = x @ W^T with W as signed 8-bit codes, an fp16 scale per half
// group of 16 inputs and an fp16 minimum per group of 32 (w = code x scale + minimum). Per row, group and block:
//   dot = (scale_lo x scale_x) x sum_lo(code x q) + (scale_hi x scale_x) x sum_hi(code x q)
//         + min_w x (scale_x x sum(q)),
// the integer sums exact, the rest in fp32 in one fixed order, so every path gives the same bits at any row count.
// Q8_0, Q5_0 and Q6_K blocks hold their codes exactly so (Q6_K's scale is per 16 weights); Q5_1 and Q5_K add the
// minimum (app/models/gguf_blocks.py maps each).
//
// Layout (`pack8`), one block of 608 bytes per tile of 16 output rows and group of 32 inputs:
//   bytes 0..511: eight chunks of 64 bytes; chunk c holds columns 4c..4c+3 as 16 rows x 4 codes in row order, each
//   code stored as code + 128 (unsigned, for vpdpbusd);
//   bytes 512..543: the rows' scales for columns 0..15, 544..575 for columns 16..31, 576..607: minimums (fp16).
// vpdpbusd multiplies unsigned weights by signed activations, so the AVX512-VNNI path sums (code + 128) x q and takes
// 128 x sum(q) off in integers; AVX2 sums code x q directly with vpsignb (|code| <= 128, |q| <= 127: a pair of
// products fits vpmaddubsw's int16). Both give the same integer, hence the same bits.

constexpr int64_t BLOCK8 = 608, SCALES8 = 512, MINIMUMS8 = 576, HALF = 16;

// sum(q) per half block of 16, per row: the VNNI path's correction and nothing else.
inline std::vector<int32_t> half_sums(const Activations& a, int64_t rows, int64_t k) {
  std::vector<int32_t> sums(rows * k / HALF);
  for (size_t h = 0; h < sums.size(); ++h) {
    int32_t s = 0;
    for (int j = 0; j < HALF; ++j) s += a.q[h * HALF + j];
    sums[h] = s;
  }
  return sums;
}

// The chunk, row and position of (row r of the tile, column c of the group).
inline int code_byte8(int r, int c) { return (c / 4) * 64 + r * 4 + c % 4; }

template <int ROWS, typename T>
void tile8_reference(const uint8_t* w, const Activations& a, const int32_t*, int64_t m0, int64_t k, T* out,
                     int64_t n, int64_t t) {
  const int64_t groups = k / GROUP;
  for (int i = 0; i < ROWS; ++i) {
    float acc[TILE] = {0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = w + g * BLOCK8;
      const int8_t* q = a.q.data() + (m0 + i) * k + g * GROUP;
      const float sx = a.scale[(m0 + i) * groups + g], c = a.scaled_sum[(m0 + i) * groups + g];
      for (int r = 0; r < TILE; ++r) {
        int32_t sum[2] = {0, 0};
        for (int col = 0; col < GROUP; ++col) sum[col / HALF] += (blk[code_byte8(r, col)] - 128) * q[col];
        for (int h = 0; h < 2; ++h)
          acc[r] = std::fma(static_cast<float>(sum[h]), half_at(blk + SCALES8 + 32 * h + 2 * r) * sx, acc[r]);
        acc[r] = std::fma(half_at(blk + MINIMUMS8 + 2 * r), c, acc[r]);
      }
    }
    store_row(out + (m0 + i) * n + t * TILE, acc, std::min<int64_t>(TILE, n - t * TILE));
  }
}

// AVX2: each 8-row half of the tile in turn; per chunk, vpmaddubsw(|code|, q signed by code) then vpmaddwd by 1.
template <int ROWS, typename T>
__attribute__((target("avx2,fma,f16c"))) void tile8_avx2(const uint8_t* w, const Activations& a, const int32_t*,
                                                         int64_t m0, int64_t k, T* out, int64_t n, int64_t t) {
  const int64_t groups = k / GROUP;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = w + g * BLOCK8;
      // As the int4 path does, the same bytes ahead. Zen 3, 12 layers of 0.5B shapes out of cache, medians of 6
      // alternated: one row the same (13.4 ms against 13.2), two 16.4 against 22.5, four 21.5 against 30.6.
      if (h == 0) prefetch_ahead(blk, BLOCK8);
      __m256i code[8], size[8];
      for (int c = 0; c < 8; ++c) {
        code[c] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h)), flip);
        size[c] = _mm256_abs_epi8(code[c]);  // -128 gives 0x80, which vpmaddubsw reads as 128
      }
      const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + SCALES8 + 16 * h)));
      const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + SCALES8 + 32 + 16 * h)));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + MINIMUMS8 + 16 * h)));
      for (int i = 0; i < ROWS; ++i) {
        const int8_t* q = a.q.data() + (m0 + i) * k + g * GROUP;
        int32_t chunk[8];
        std::memcpy(chunk, q, GROUP);
        __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int c = 0; c < 8; ++c) {
          const __m256i signed_q = _mm256_sign_epi8(_mm256_set1_epi32(chunk[c]), code[c]);
          s[c / 4] = _mm256_add_epi32(s[c / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(size[c], signed_q), ones));
        }
        const int64_t at = (m0 + i) * groups + g;
        const __m256 sx = _mm256_set1_ps(a.scale[at]);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(lo, sx), acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(hi, sx), acc[i]);
        acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.scaled_sum[at]), acc[i]);
      }
    }
    store_half<ROWS>(acc, out, m0, n, t, h);
  }
}

template <int ROWS, typename T>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma"))) void tile8_vnni(
    const uint8_t* w, const Activations& a, const int32_t* sums, int64_t m0, int64_t k, T* out, int64_t n,
    int64_t t) {
  const int64_t groups = k / GROUP;
  __m512 acc[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * BLOCK8;
    __m512i code[8];
    for (int c = 0; c < 8; ++c) code[c] = _mm512_loadu_si512(blk + 64 * c);
    const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + SCALES8)));
    const __m512 hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + SCALES8 + 32)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + MINIMUMS8)));
    for (int i = 0; i < ROWS; ++i) {
      const int8_t* q = a.q.data() + (m0 + i) * k + g * GROUP;
      int32_t chunk[8];
      std::memcpy(chunk, q, GROUP);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // columns 0..15 and 16..31
      for (int c = 0; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, code[c], _mm512_set1_epi32(chunk[c]));
        s1 = _mm512_dpbusd_epi32(s1, code[c + 4], _mm512_set1_epi32(chunk[c + 4]));
      }
      const int64_t at = (m0 + i) * groups + g;
      s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(128 * sums[2 * at]));
      s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(128 * sums[2 * at + 1]));
      const __m512 sx = _mm512_set1_ps(a.scale[at]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(lo, sx), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(hi, sx), acc[i]);
      acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.scaled_sum[at]), acc[i]);
    }
  }
  store_tile<ROWS>(acc, out, m0, n, t);
}

template <typename T>
void multiply8(const T* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k, int path) {
  const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
  const Activations a = quantize_rows(x, m, k, path != REFERENCE);
  const std::vector<int32_t> sums = path == VNNI ? half_sums(a, m, k) : std::vector<int32_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m0 = 0; m0 < m; m0 += MAX_BLOCK_ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(MAX_BLOCK_ROWS, m - m0));
        const uint8_t* tile = w + t * groups * BLOCK8;
#define INT8_ROWS(FN)                                                          \
  switch (rows) {                                                              \
    case 1: FN<1, T>(tile, a, sums.data(), m0, k, out, n, t); break;           \
    case 2: FN<2, T>(tile, a, sums.data(), m0, k, out, n, t); break;           \
    case 3: FN<3, T>(tile, a, sums.data(), m0, k, out, n, t); break;           \
    default: FN<4, T>(tile, a, sums.data(), m0, k, out, n, t); break;          \
  }
        if (path == VNNI) {
          INT8_ROWS(tile8_vnni)
        } else if (path == AVX2) {
          INT8_ROWS(tile8_avx2)
        } else {
          INT8_ROWS(tile8_reference)
        }
#undef INT8_ROWS
      }
  });
}
