// What the C++ CPU ops share: reading any activation dtype as float, a vectorisable exp, and the
// switch from a tensor's dtype to a template argument.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sluice_cpu {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

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
