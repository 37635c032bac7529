// QUANT=int4's decode kernel (app/models/int4_decode.py builds and loads it): y[M, N] = x[M, K] @ W^T for a few
// rows, W as 4-bit codes with an fp16 scale and minimum per group of 32 inputs (w = code x scale + min), x
// quantized per block of 32 to int8 (symmetric absmax, fp32 scale). Per row, group and block:
//   dot = (scale_w x scale_x) x sum(code x q) + min_w x (scale_x x sum(q)),
// the integer sum exact, the rest in fp32 in one fixed order, so every path gives the same bits, at any row count.
//
// Layout (`pack`), one block of 320 bytes per tile of 16 output rows and group of 32 inputs:
//   bytes 0..255: four segments of 64 bytes; segment s holds column chunk s (columns 4s..4s+3) in its low nibbles
//   and chunk s + 4 in its high ones, each chunk as 16 rows x 4 codes in row order;
//   bytes 256..287: the 16 rows' scales, 288..319: their minimums (fp16).
// So one 64-byte chunk times the row's 4 activations of that chunk, broadcast, gives each 32-bit lane one output
// row's 4 products (vpdpbusd; AVX2's vpmaddubsw + vpmaddwd on each 8-row half), as llama.cpp's interleaved
// Q4_0_8x8 blocks do: no horizontal sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32, TILE = 16, BLOCK = 320, SCALES = 256, MINIMUMS = 288;
constexpr int MAX_BLOCK_ROWS = 4;  // activation rows per pass over a tile's weights (they stay in L1/L2 between)

struct Activations {  // x quantized: q [M, K] int8, per block of 32: its scale d and d x sum(q)
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;
  Activations(int64_t rows, int64_t k) : q(rows * k), scale(rows * k / GROUP), scaled_sum(rows * k / GROUP) {}
};

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }

// Every path quantizes with the same IEEE operations (|x| max, d = amax / 127, 1 / d, x / d rounded to even), so
// the vectorized version below gives the same bytes as this one.
template <typename T>
void quantize_block(const T* v, int8_t* q, float* scale, float* scaled_sum) {
  float amax = 0.f;
  for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(as_float(v[j])));
  const float d = amax / 127.f, inv = amax > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < GROUP; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyintf(as_float(v[j]) * inv));
    sum += q[j];
  }
  *scale = d;
  *scaled_sum = d * static_cast<float>(sum);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* v) { return _mm256_loadu_ps(v); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::BFloat16* v) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void quantize_block_avx2(const T* v, int8_t* q, float* scale,
                                                                  float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    x[j] = load8(v + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float top = _mm_cvtss_f32(m4), d = top / 127.f, inv = top > 0.f ? 1.f / d : 0.f;
  __m256i sum = _mm256_setzero_si256();
  alignas(32) int32_t ints[GROUP];
  for (int j = 0; j < 4; ++j) {
    const __m256i i = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x[j], _mm256_set1_ps(inv)),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = _mm256_add_epi32(sum, i);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * j), i);
  }
  for (int j = 0; j < GROUP; ++j) q[j] = static_cast<int8_t>(ints[j]);
  alignas(32) int32_t parts[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
  int32_t total = 0;
  for (int j = 0; j < 8; ++j) total += parts[j];
  *scale = d;
  *scaled_sum = d * static_cast<float>(total);
}

template <typename T>
Activations quantize_rows(const T* x, int64_t rows, int64_t k, bool vector) {
  Activations a(rows, k);
  for (int64_t i = 0; i < rows * k / GROUP; ++i) {
    if (vector)
      quantize_block_avx2(x + i * GROUP, a.q.data() + i * GROUP, &a.scale[i], &a.scaled_sum[i]);
    else
      quantize_block(x + i * GROUP, a.q.data() + i * GROUP, &a.scale[i], &a.scaled_sum[i]);
  }
  return a;
}

// Where the code of (row r of the tile, column c of the group) lies: its byte, and whether in the high nibble.
inline int code_byte(int r, int c) { return (c / 4 % 4) * 64 + r * 4 + c % 4; }
inline bool code_high(int c) { return c >= 16; }

template <typename T>
inline void store_row(T* out, const float* acc, int64_t count) {
  for (int64_t j = 0; j < count; ++j) out[j] = static_cast<T>(acc[j]);
}

inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// The reference: the same arithmetic, one value at a time, read from the same layout.
template <int ROWS, typename T>
void tile_reference(const uint8_t* w, const Activations& a, int64_t m0, int64_t k, T* out, int64_t n, int64_t t) {
  const int64_t groups = k / GROUP;
  for (int i = 0; i < ROWS; ++i) {
    float acc[TILE] = {0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = w + g * BLOCK;
      const int8_t* q = a.q.data() + (m0 + i) * k + g * GROUP;
      const float sx = a.scale[(m0 + i) * groups + g], c = a.scaled_sum[(m0 + i) * groups + g];
      for (int r = 0; r < TILE; ++r) {
        int32_t sum = 0;
        for (int col = 0; col < GROUP; ++col) {
          const uint8_t byte = blk[code_byte(r, col)];
          sum += (code_high(col) ? byte >> 4 : byte & 15) * q[col];
        }
        const float scale = half_at(blk + SCALES + 2 * r) * sx;
        acc[r] = std::fma(static_cast<float>(sum), scale, acc[r]);
        acc[r] = std::fma(half_at(blk + MINIMUMS + 2 * r), c, acc[r]);
      }
    }
    store_row(out + (m0 + i) * n + t * TILE, acc, std::min<int64_t>(TILE, n - t * TILE));
  }
}

// A pass's accumulators into the output rows: AVX2's 8-row half h of tile t, AVX-512's whole tile.
template <int ROWS, typename T>
__attribute__((target("avx2,fma,f16c"))) void store_half(const __m256* acc, T* out, int64_t m0, int64_t n, int64_t t,
                                                         int h) {
  for (int i = 0; i < ROWS; ++i) {
    alignas(32) float row[8];
    _mm256_store_ps(row, acc[i]);
    const int64_t first = t * TILE + 8 * h;
    if (first < n) store_row(out + (m0 + i) * n + first, row, std::min<int64_t>(8, n - first));
  }
}

template <int ROWS, typename T>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma"))) void store_tile(
    const __m512* acc, T* out, int64_t m0, int64_t n, int64_t t) {
  for (int i = 0; i < ROWS; ++i) {
    alignas(64) float row[TILE];
    _mm512_store_ps(row, acc[i]);
    store_row(out + (m0 + i) * n + t * TILE, row, std::min<int64_t>(TILE, n - t * TILE));
  }
}

// AVX2: each 8-row half of the tile; a row's 8 chunks summed in int16 (at most 8 x 2 x 15 x 127 = 30,480). With
// one or two activation rows both halves are done in one pass over the groups, so each block is used while it is in
// L1, and the weights 32 blocks ahead are asked for. On a Zen 3 (2 cores), over 24 layers of 0.5B shapes (224 MB,
// out of cache), a step took 11.1 ms against 13.2 at one row and 12.2 against 16.1 at two (medians of 6, alternated);
// the same at 4 and 8. Each output's sums run in the same order as before: the same bits.
constexpr int64_t PREFETCH_BYTES = 32 * BLOCK;

// Asks for the block of `bytes` that lies about PREFETCH_BYTES past `blk` (both AVX2 paths, once per block).
inline void prefetch_ahead(const uint8_t* blk, int64_t bytes) {
  const uint8_t* ahead = blk + PREFETCH_BYTES / bytes * bytes;
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
}

template <int ROWS, typename T>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* w, const Activations& a, int64_t m0,
                                                        int64_t k, T* out, int64_t n, int64_t t) {
  constexpr int AT_ONCE = ROWS <= 2 ? 2 : 1;  // halves per pass: 2 x ROWS accumulators fit the 16 registers
  const int64_t groups = k / GROUP;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h0 = 0; h0 < 2; h0 += AT_ONCE) {
    __m256 acc[AT_ONCE][ROWS];
    for (int hh = 0; hh < AT_ONCE; ++hh)
      for (int i = 0; i < ROWS; ++i) acc[hh][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = w + g * BLOCK;
      if (h0 == 0) prefetch_ahead(blk, BLOCK);
      for (int hh = 0; hh < AT_ONCE; ++hh) {
        const int h = h0 + hh;
        __m256i s[ROWS];
        for (int i = 0; i < ROWS; ++i) s[i] = _mm256_setzero_si256();
        for (int seg = 0; seg < 4; ++seg) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * seg + 32 * h));
          const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
          for (int i = 0; i < ROWS; ++i) {
            const int8_t* q = a.q.data() + (m0 + i) * k + g * GROUP;
            int32_t first, second;
            std::memcpy(&first, q + 4 * seg, 4);
            std::memcpy(&second, q + 16 + 4 * seg, 4);
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(first)));
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(second)));
          }
        }
        const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + SCALES + 16 * h)));
        const __m256 mw =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + MINIMUMS + 16 * h)));
        for (int i = 0; i < ROWS; ++i) {
          const int64_t at = (m0 + i) * groups + g;
          const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(a.scale[at]));
          acc[hh][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[i], ones)), scale, acc[hh][i]);
          acc[hh][i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.scaled_sum[at]), acc[hh][i]);
        }
      }
    }
    for (int hh = 0; hh < AT_ONCE; ++hh) store_half<ROWS>(acc[hh], out, m0, n, t, h0 + hh);
  }
}

template <int ROWS, typename T>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma"))) void tile_vnni(
    const uint8_t* w, const Activations& a, int64_t m0, int64_t k, T* out, int64_t n, int64_t t) {
  const int64_t groups = k / GROUP;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * BLOCK;
    __m512i code[8];
    for (int seg = 0; seg < 4; ++seg) {
      const __m512i b = _mm512_loadu_si512(blk + 64 * seg);
      code[seg] = _mm512_and_si512(b, low);
      code[seg + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + SCALES)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + MINIMUMS)));
    for (int i = 0; i < ROWS; ++i) {
      const int8_t* q = a.q.data() + (m0 + i) * k + g * GROUP;
      int32_t chunk[8];
      std::memcpy(chunk, q, GROUP);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains, then one sum
      for (int c = 0; c < 8; c += 2) {
        s0 = _mm512_dpbusd_epi32(s0, code[c], _mm512_set1_epi32(chunk[c]));
        s1 = _mm512_dpbusd_epi32(s1, code[c + 1], _mm512_set1_epi32(chunk[c + 1]));
      }
      const int64_t at = (m0 + i) * groups + g;
      const __m512 scale = _mm512_mul_ps(sw, _mm512_set1_ps(a.scale[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[i]);
      acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.scaled_sum[at]), acc[i]);
    }
  }
  store_tile<ROWS>(acc, out, m0, n, t);
}

enum Path { REFERENCE = 0, AVX2 = 1, VNNI = 2 };

template <typename T>
void run_tile(int path, const uint8_t* w, const Activations& a, int64_t m0, int rows, int64_t k, T* out,
              int64_t n, int64_t t) {
#define INT4_ROWS(FN)                                        \
  switch (rows) {                                            \
    case 1: FN<1, T>(w, a, m0, k, out, n, t); break;         \
    case 2: FN<2, T>(w, a, m0, k, out, n, t); break;         \
    case 3: FN<3, T>(w, a, m0, k, out, n, t); break;         \
    default: FN<4, T>(w, a, m0, k, out, n, t); break;        \
  }
  if (path == VNNI) {
    INT4_ROWS(tile_vnni)
  } else if (path == AVX2) {
    INT4_ROWS(tile_avx2)
  } else {
    INT4_ROWS(tile_reference)
  }
#undef INT4_ROWS
}

bool path_supported(int64_t path) {
  __builtin_cpu_init();
  if (path == VNNI)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  if (path == AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return path == REFERENCE;
}

template <typename T>
void multiply(const T* x, const uint8_t* w, T* out, int64_t m, int64_t n, int64_t k, int path) {
  const int64_t groups = k / GROUP, tiles = (n + TILE - 1) / TILE;
  const Activations a = quantize_rows(x, m, k, path != REFERENCE);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m0 = 0; m0 < m; m0 += MAX_BLOCK_ROWS)
        run_tile<T>(path, w + t * groups * BLOCK, a, m0, std::min<int64_t>(MAX_BLOCK_ROWS, m - m0), k, out, n, t);
  });
}

#include "int8_groups.h"

}  // namespace

// A zeroed buffer of `block` bytes per tile of 16 rows and group of 32 inputs, each (row, group) written by `fill`.
template <typename Fill>
torch::Tensor pack_blocks(int64_t n, int64_t groups, int64_t block, Fill&& fill) {
  const int64_t tiles = (n + TILE - 1) / TILE;
  auto out = torch::zeros({tiles * groups * block}, torch::dtype(torch::kUInt8));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int r = 0; r < TILE && t * TILE + r < n; ++r)
        for (int64_t g = 0; g < groups; ++g) fill(o + (t * groups + g) * block, t * TILE + r, r, g);
  });
  return out;
}

// codes [N, K] (0..15, any integer dtype), scale and minimum [N, K / 32] fp16 -> the layout above, uint8.
torch::Tensor pack(torch::Tensor codes, torch::Tensor scale, torch::Tensor minimum) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % GROUP == 0, "codes must be [N, K] with K a multiple of 32");
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / GROUP;
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf, "scales must be fp16");
  TORCH_CHECK(scale.sizes() == minimum.sizes() && scale.size(0) == n && scale.size(1) == groups, "scale shape");
  auto c = codes.to(at::kByte).contiguous();
  auto s = scale.contiguous(), mn = minimum.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const at::Half *sp = s.data_ptr<at::Half>(), *mp = mn.data_ptr<at::Half>();
  return pack_blocks(n, groups, BLOCK, [&](uint8_t* blk, int64_t row, int r, int64_t g) {
    for (int col = 0; col < GROUP; ++col) {
      const uint8_t v = cp[row * k + g * GROUP + col] & 15;
      blk[code_byte(r, col)] |= code_high(col) ? static_cast<uint8_t>(v << 4) : v;
    }
    std::memcpy(blk + SCALES + 2 * r, sp + row * groups + g, 2);
    std::memcpy(blk + MINIMUMS + 2 * r, mp + row * groups + g, 2);
  });
}

// x [M, K] fp32 or bf16 -> [M, N] in x's dtype, over `pack`'s layout (`eight`: `pack8`'s), on path 0 (reference),
// 1 (AVX2) or 2 (AVX512-VNNI).
static torch::Tensor run(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t path, bool eight) {
  TORCH_CHECK(path_supported(path), "this CPU cannot run int4 decode path ", path);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % GROUP == 0, "x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(packed.numel() == tiles * (k / GROUP) * (eight ? BLOCK8 : BLOCK), "packed weights do not match K and N");
  auto out = torch::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    auto fn = eight ? multiply8<float> : multiply<float>;
    fn(x.data_ptr<float>(), w, out.data_ptr<float>(), m, n, k, path);
  } else if (x.scalar_type() == at::kBFloat16) {
    auto fn = eight ? multiply8<at::BFloat16> : multiply<at::BFloat16>;
    fn(x.data_ptr<at::BFloat16>(), w, out.data_ptr<at::BFloat16>(), m, n, k, path);
  } else {
    TORCH_CHECK(false, "x must be fp32 or bf16");
  }
  return out;
}

torch::Tensor matmul(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t path) {
  return run(x, packed, n, path, false);
}

// codes [N, K] int8, scale [N, K / 16] and minimum [N, K / 32] fp16 -> int8_groups.h's layout, uint8.
torch::Tensor pack8(torch::Tensor codes, torch::Tensor scale, torch::Tensor minimum) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % GROUP == 0 && codes.scalar_type() == at::kChar,
              "codes must be int8 [N, K] with K a multiple of 32");
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / GROUP;
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf, "scales must be fp16");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.size(1) == 2 * groups, "scale must be [N, K / 16]");
  TORCH_CHECK(minimum.dim() == 2 && minimum.size(0) == n && minimum.size(1) == groups, "minimum must be [N, K / 32]");
  auto c = codes.contiguous();
  auto s = scale.contiguous(), mn = minimum.contiguous();
  const int8_t* cp = c.data_ptr<int8_t>();
  const at::Half *sp = s.data_ptr<at::Half>(), *mp = mn.data_ptr<at::Half>();
  return pack_blocks(n, groups, BLOCK8, [&](uint8_t* blk, int64_t row, int r, int64_t g) {
    for (int col = 0; col < GROUP; ++col)
      blk[code_byte8(r, col)] = static_cast<uint8_t>(cp[row * k + g * GROUP + col] + 128);
    for (int h = 0; h < 2; ++h) std::memcpy(blk + SCALES8 + 32 * h + 2 * r, sp + row * 2 * groups + 2 * g + h, 2);
    std::memcpy(blk + MINIMUMS8 + 2 * r, mp + row * groups + g, 2);
  });
}

torch::Tensor matmul8(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t path) {
  return run(x, packed, n, path, true);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack8", &pack8, "8-bit codes, fp16 half-group scales and group minimums -> int8_groups.h's layout");
  m.def("matmul8", &matmul8, "x [M, K] @ W^T over 8-bit codes with int8 activations");
  m.def("pack", &pack, "4-bit codes, fp16 scales and minimums -> the decode kernel's layout");
  m.def("matmul", &matmul, "x [M, K] @ W^T with int8 activations");
  m.def("supported", &path_supported, "whether this CPU runs a path (0 reference, 1 AVX2, 2 AVX512-VNNI)");
}
