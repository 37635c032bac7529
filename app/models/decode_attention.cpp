// Decode attention on the CPU (app/models/decode_attention.py builds and loads it): one query row per request,
// grouped-query attention over that request's keys and values where its cache keeps them, bf16 / fp16 / fp32 or
// 8-bit codes with fp16 scales (app/core/runner/kv_store.py's `Int8Layer`), in one pass per KV head: scores,
// softmax and the weighted sum of values, all in fp32. Nothing is copied or dequantized into a scratch tensor
// first, which is what the torch version (`grouped_decode_attention` over a cast copy) spends its time on at long
// contexts.
//
// Work items are (request, KV head) pairs, spread over torch's threads; each reads its KV head's keys and values
// once for all the query heads that share it. A row's result depends only on that row, whatever else is in the
// batch. The loops are written for the compiler to vectorize (tokens innermost where the 8-bit keys keep them,
// channels innermost elsewhere) and the body is compiled three times, for AVX-512, for AVX2 and for the baseline
// (target attributes), so one build serves every x86 CPU and the path is chosen at run time. The paths add in
// different vector widths, so their fp32 sums round differently; tests/fast/test_decode_attention_kernel.py bounds them
// against the torch version.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#define INLINE inline __attribute__((always_inline))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

// Cephes' expf for x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
// e^r, then 2^n from its exponent bits; within 2 ulp of expf. Each instruction set below spells it in its own
// vectors; the constants are shared.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f, LOWEST = -87.f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f, P3 = 4.1665795894e-2f,
                P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

struct Scalar {  // one lane: the baseline build, and the tails of the vector paths
  using V = float;
  static constexpr int64_t W = 1, HEADS = 4;
  static constexpr int value_cols(int) { return 4; }
  static INLINE V zero() { return 0.f; }
  static INLINE V set1(float v) { return v; }
  static INLINE V load(const float* p) { return *p; }
  static INLINE V load(const at::BFloat16* p) {
    const uint32_t bits = static_cast<uint32_t>(p->x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static INLINE V load(const at::Half* p) { return static_cast<float>(*p); }
  static INLINE float half(const at::Half* p) { return static_cast<float>(*p); }  // one fp16 scale
  static INLINE V load(const int8_t* p) { return static_cast<float>(*p); }
  static INLINE void store(float* p, V v) { *p = v; }
  static INLINE V fma(V a, V b, V c) { return a * b + c; }
  static INLINE V mul(V a, V b) { return a * b; }
  static INLINE V add(V a, V b) { return a + b; }
  static INLINE V max(V a, V b) { return std::max(a, b); }
  static INLINE float sum(V v) { return v; }
  static INLINE void sum4(V a, V b, V c, V d, float* out) { out[0] = a, out[1] = b, out[2] = c, out[3] = d; }
  static INLINE float top(V v) { return v; }
  static INLINE V exp(V x) {
    x = std::max(x, LOWEST);
    const float n = std::floor(x * LOG2E + 0.5f), r = x - n * LN2_HI - n * LN2_LO;
    const float p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return (p * r * r + r + 1.f) * two_n;
  }
};

struct Avx2 {
  using V = __m256;
  // 16 registers: 2 heads x 4 vectors of dense value columns and 4 of a value row; 8-bit value columns: HS heads x
  // COLS sums, COLS of the row, the weight and the scale
  static constexpr int64_t W = 8, HEADS = 2;
  static constexpr int value_cols(int heads) { return heads <= 2 ? 4 : heads <= 6 ? 2 : 1; }
  static AVX2 INLINE V zero() { return _mm256_setzero_ps(); }
  static AVX2 INLINE V set1(float v) { return _mm256_set1_ps(v); }
  static AVX2 INLINE V load(const float* p) { return _mm256_loadu_ps(p); }
  static AVX2 INLINE V load(const at::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static AVX2 INLINE V load(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static AVX2 INLINE float half(const at::Half* p) { return _cvtsh_ss(p->x); }
  static AVX2 INLINE V load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static AVX2 INLINE void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static AVX2 INLINE V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static AVX2 INLINE V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static AVX2 INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
  static AVX2 INLINE V max(V a, V b) { return _mm256_max_ps(a, b); }
  static AVX2 INLINE float sum(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  // Four dot products' lanes summed at once, [sum(a), sum(b), sum(c), sum(d)] (three horizontal adds, not twelve).
  static AVX2 INLINE void sum4(V a, V b, V c, V d, float* out) {
    const V abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // each 128-bit half: its 4 sums
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static AVX2 INLINE float top(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static AVX2 INLINE V exp(V x) {
    x = _mm256_max_ps(x, set1(LOWEST));
    const V n = _mm256_floor_ps(_mm256_fmadd_ps(x, set1(LOG2E), set1(0.5f)));
    const V r = _mm256_fnmadd_ps(n, set1(LN2_LO), _mm256_fnmadd_ps(n, set1(LN2_HI), x));
    V p = _mm256_fmadd_ps(set1(P0), r, set1(P1));
    p = _mm256_fmadd_ps(p, r, set1(P2));
    p = _mm256_fmadd_ps(p, r, set1(P3));
    p = _mm256_fmadd_ps(p, r, set1(P4));
    p = _mm256_fmadd_ps(p, r, set1(P5));
    const V y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), set1(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
};

struct Avx512 {
  using V = __m512;
  // 32 registers: 4 heads x 4 vectors of dense value columns and 4 of a value row; 8-bit value columns as on AVX2
  // in twice the registers
  static constexpr int64_t W = 16, HEADS = 4;
  static constexpr int value_cols(int heads) { return heads <= 6 ? 4 : 2; }
  static AVX512 INLINE V zero() { return _mm512_setzero_ps(); }
  static AVX512 INLINE V set1(float v) { return _mm512_set1_ps(v); }
  static AVX512 INLINE V load(const float* p) { return _mm512_loadu_ps(p); }
  static AVX512 INLINE V load(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static AVX512 INLINE V load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static AVX512 INLINE float half(const at::Half* p) { return _cvtsh_ss(p->x); }
  static AVX512 INLINE V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static AVX512 INLINE void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static AVX512 INLINE V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static AVX512 INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static AVX512 INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
  static AVX512 INLINE V max(V a, V b) { return _mm512_max_ps(a, b); }
  static AVX512 INLINE float sum(V v) { return _mm512_reduce_add_ps(v); }
  static AVX512 INLINE float top(V v) { return _mm512_reduce_max_ps(v); }
  // Four dot products' lanes summed at once: pairs interleaved and added, then each 128-bit block holds the four
  // partial sums, and the blocks are added.
  static AVX512 INLINE void sum4(V a, V b, V c, V d, float* out) {
    const V ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const V cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const V abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  }
  static AVX512 INLINE V exp(V x) {
    x = _mm512_max_ps(x, set1(LOWEST));
    const V n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, set1(LOG2E), set1(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const V r = _mm512_fnmadd_ps(n, set1(LN2_LO), _mm512_fnmadd_ps(n, set1(LN2_HI), x));
    V p = _mm512_fmadd_ps(set1(P0), r, set1(P1));
    p = _mm512_fmadd_ps(p, r, set1(P2));
    p = _mm512_fmadd_ps(p, r, set1(P3));
    p = _mm512_fmadd_ps(p, r, set1(P4));
    p = _mm512_fmadd_ps(p, r, set1(P5));
    const V y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), set1(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  }
};

// How far ahead rows are asked for from memory: a row of tokens (8-bit keys, tokens innermost) and a token's
// row (dense keys, values). From DRAM, a long cache read ~15% faster with them (timed on a Zen 4, caches flushed).
constexpr int64_t PREFETCH_TOKENS = 256, AHEAD = 16;

INLINE void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

struct Part {  // one request's keys or values for one KV head: element (token t, channel c) of codes and scales
  const void* codes;
  int64_t token_stride, channel_stride;
  const at::Half* scales;  // null: dense
  int64_t scale_token_stride, scale_channel_stride, group;  // channels per scale
};

namespace reference {
using S = Scalar;
#include "decode_attention_body.h"
}  // namespace reference

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
using S = Avx2;
#include "decode_attention_body.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
using S = Avx512;
#include "decode_attention_body.h"
}  // namespace avx512
#pragma GCC pop_options

// A path's vectors need whole vectors of channels; a head size that is not one takes the one-lane body.
template <typename K>
void attend_path(int64_t path, const float* q, int64_t heads, int64_t d, int64_t dv, const Part& k, const Part& v,
                 int64_t n, float scaling, float* out) {
  if (path == 2 && d % Avx512::W == 0 && dv % Avx512::W == 0)
    avx512::attend<K>(q, heads, d, dv, k, v, n, scaling, out);
  else if (path >= 1 && d % Avx2::W == 0 && dv % Avx2::W == 0)
    avx2::attend<K>(q, heads, d, dv, k, v, n, scaling, out);
  else
    reference::attend<K>(q, heads, d, dv, k, v, n, scaling, out);
}

bool path_supported(int64_t path) {
  if (path == 0) return true;
  __builtin_cpu_init();
  if (path == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (path == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return false;
}

// codes [kv_heads, n, d] (any strides) and scales [kv_heads, n, groups] or an empty tensor (dense) -> one head's Part.
Part part_of(const at::Tensor& codes, const at::Tensor& scales, int64_t head) {
  const int64_t element = codes.element_size();
  Part p{static_cast<const char*>(codes.data_ptr()) + head * codes.stride(0) * element, codes.stride(1),
         codes.stride(2), nullptr, 0, 0, codes.size(2)};
  if (scales.numel() > 0) {
    p.scales = scales.data_ptr<at::Half>() + head * scales.stride(0);
    p.scale_token_stride = scales.stride(1);
    p.scale_channel_stride = scales.stride(2);
    p.group = codes.size(2) / scales.size(2);
  }
  return p;
}

void check_part(const at::Tensor& codes, const at::Tensor& scales, bool keys, int64_t kv_heads, const char* what) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(0) == kv_heads, what, ": [kv_heads, n, d] expected");
  if (scales.numel() == 0) {
    TORCH_CHECK(codes.stride(2) == 1, what, ": dense keys and values need channels innermost");
    return;
  }
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf, what,
              ": 8-bit parts are int8 codes with fp16 scales");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == codes.size(1) && codes.size(2) % scales.size(2) == 0, what,
              ": scales [kv_heads, n, d / group] expected");
  if (keys) {
    TORCH_CHECK(codes.stride(1) == 1 && scales.stride(1) == 1, what, ": 8-bit keys need tokens innermost");
  } else {
    TORCH_CHECK(codes.stride(2) == 1 && scales.stride(2) == 1, what, ": 8-bit values need channels innermost");
  }
}

// q [B, heads, d] fp32; per request b: keys[b], values[b] [kv_heads, n_b, d or dv] (dense, or int8 codes with
// scales) -> [B, heads, dv] fp32.
at::Tensor attend(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& key_scales,
                  const std::vector<at::Tensor>& values, const std::vector<at::Tensor>& value_scales, double scaling,
                  int64_t path) {
  TORCH_CHECK(path_supported(path), "this CPU cannot run decode attention path ", path);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [B, heads, d] fp32");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  if (batch == 0) return at::empty({0, heads, values.empty() ? d : values[0].size(2)}, q.options());
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == batch && key_scales.size() == keys.size() &&
                  values.size() == keys.size() && value_scales.size() == keys.size(),
              "one key, key scale, value and value scale tensor per request");
  const int64_t kv_heads = keys[0].size(0), dv = values[0].size(2), group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  for (int64_t b = 0; b < batch; ++b) {
    check_part(keys[b], key_scales[b], true, kv_heads, "keys");
    check_part(values[b], value_scales[b], false, kv_heads, "values");
    TORCH_CHECK(keys[b].size(2) == d && values[b].size(2) == dv && values[b].size(1) == keys[b].size(1),
                "keys and values of one request must match in tokens and match q in channels");
    TORCH_CHECK(keys[b].size(1) > 0, "a request with no keys");
    const auto kt = keys[b].scalar_type();
    TORCH_CHECK(kt == values[b].scalar_type(), "keys and values of one request in one dtype");
    TORCH_CHECK(kt == at::kBFloat16 || kt == at::kHalf || kt == at::kFloat || kt == at::kChar, "keys in ", kt,
                " are not supported");
  }
  auto out = at::empty({batch, heads, dv}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, n = keys[b].size(1);
      const Part k = part_of(keys[b], key_scales[b], h), v = part_of(values[b], value_scales[b], h);
      const float* qh = qp + (b * heads + h * group) * d;
      float* oh = op + (b * heads + h * group) * dv;
      const auto kt = keys[b].scalar_type();
      if (kt == at::kBFloat16)
        attend_path<at::BFloat16>(path, qh, group, d, dv, k, v, n, scaling, oh);
      else if (kt == at::kHalf)
        attend_path<at::Half>(path, qh, group, d, dv, k, v, n, scaling, oh);
      else if (kt == at::kFloat)
        attend_path<float>(path, qh, group, d, dv, k, v, n, scaling, oh);
      else if (kt == at::kChar)
        attend_path<int8_t>(path, qh, group, d, dv, k, v, n, scaling, oh);
    }
  });
  return out;
}

// One token and head's channels x[0..d) into int8 codes and an fp16 scale per group of `group`, as
// kv_store.quantize_kv does in torch ops, bit for bit: scale = fp16(absmax / 127), code = round-to-even(x / scale)
// clamped to +-127 (an all-zero group: codes 0).
template <typename T>
void quantize_group(const T* x, int64_t x_stride, int64_t group, int8_t* codes, int64_t code_stride, at::Half* scale) {
  float top = 0.f;
  for (int64_t c = 0; c < group; ++c) top = std::max(top, std::fabs(static_cast<float>(x[c * x_stride])));
  const at::Half stored(std::min(top / 127.f, 65504.f));
  *scale = stored;
  const float divisor = std::max(static_cast<float>(stored), std::numeric_limits<float>::min());
  for (int64_t c = 0; c < group; ++c) {
    const float code = std::nearbyint(static_cast<float>(x[c * x_stride]) / divisor);
    codes[c * code_stride] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
}

template <typename T>
void quantize_part(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t heads = x.size(0), n = x.size(1), d = x.size(2), group = d / scales.size(2);
  const T* xp = x.data_ptr<T>();
  int8_t* cp = codes.data_ptr<int8_t>();
  at::Half* sp = scales.data_ptr<at::Half>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t g = 0; g < d / group; ++g)
        quantize_group<T>(xp + h * x.stride(0) + t * x.stride(1) + g * group * x.stride(2), x.stride(2), group,
                          cp + h * codes.stride(0) + t * codes.stride(1) + g * group * codes.stride(2),
                          codes.stride(2), sp + h * scales.stride(0) + t * scales.stride(1) + g * scales.stride(2));
}

// New tokens' keys or values x [kv_heads, n, d] (bf16, fp16 or fp32, any strides) written as codes [kv_heads, n, d]
// and scales [kv_heads, n, d / group] (int8 and fp16 views of an 8-bit cache's storage, any strides).
void quantize_into(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 3 && codes.sizes() == x.sizes() && scales.dim() == 3 && scales.size(0) == x.size(0) &&
                  scales.size(1) == x.size(1) && x.size(2) % scales.size(2) == 0,
              "x and codes [kv_heads, n, d], scales [kv_heads, n, d / group]");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf, "int8 codes, fp16 scales");
  if (x.scalar_type() == at::kBFloat16)
    quantize_part<at::BFloat16>(x, codes, scales);
  else if (x.scalar_type() == at::kHalf)
    quantize_part<at::Half>(x, codes, scales);
  else if (x.scalar_type() == at::kFloat)
    quantize_part<float>(x, codes, scales);
  else
    TORCH_CHECK(false, "keys and values in ", x.scalar_type(), " cannot be quantized here");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "one query row per request over its keys and values where they lie");
  m.def("quantize_into", &quantize_into, "new keys or values into an 8-bit cache's codes and scales");
  m.def("supported", &path_supported, "whether this CPU runs a path (0 reference, 1 AVX2, 2 AVX-512)");
}
