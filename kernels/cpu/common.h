// What the C++ CPU ops share: reading any activation dtype as float, a vectorisable exp, and the
// switch from a tensor's dtype to a template argument.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sluice_cpu {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// An int8 KV cache row (engine/kv_quant.py): head_dim values, then their float32 scale in these bytes.
constexpr int64_t kScaleBytes = 4;

// The scale of the int8 cache row starting at p (unaligned in general: read by memcpy).
inline float row_scale(const int8_t* p, int64_t dim) {
  float s;
  std::memcpy(&s, p + dim, sizeof(s));
  return s;
}

// exp(x) = 2^n * e^r with |r| <= ln2/2, e^r by a degree-6 polynomial: within 2 ulp of expf, in a form the
// compiler vectorises (libm's expf is a scalar call). 0 below -87, finite up to 88 (2^n in two halves:
// n reaches 127 there, past the largest exponent one float factor can carry).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t n1 = static_cast<int32_t>(n) / 2, n2 = static_cast<int32_t>(n) - n1;
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof(s1));
  std::memcpy(&s2, &b2, sizeof(s2));
  return p * s1 * s2;
}

#if defined(__AVX512F__)
// exp of 16 floats: fast_exp's polynomial, scaled by 2^n with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// f(float{}), f(at::BFloat16{}) or f(at::Half{}) for the tensor dtype; anything else is an error.
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case torch::kFloat:
      f(float{});
      break;
    case torch::kBFloat16:
      f(at::BFloat16{});
      break;
    case torch::kHalf:
      f(at::Half{});
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
}

}  // namespace sluice_cpu
