// The decoder layer's elementwise work on the CPU, one op each: residual add + RMSNorm, rotary
// embedding (q and k in place), and SiLU(gate) * up.
//
// Eager PyTorch runs each as 2-8 ops: at decode sizes the dispatches are the cost (~600 a step), at
// prefill sizes the passes over [tokens, hidden] temporaries. Each op here is one pass over its rows,
// parallel over rows on torch's thread pool. They round where the eager model (engine/models/llama.py)
// rounds, to the activation dtype; in float32 rotary is bit-identical to it (this file is built with
// -ffp-contract=off: no fused multiply-add the source did not ask for), the norm's sum of squares
// and SiLU's exp differ from torch's by an ulp or so.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using sluice_cpu::dispatch_dtype;
using sluice_cpu::fast_exp;
using sluice_cpu::to_float;

// The value of x once stored in T (round to nearest even), back as a float.
template <typename T>
inline float rounded(float x) {
  return to_float(static_cast<T>(x));
}

// Rows per parallel chunk: enough floats that a thread's share outweighs starting it.
inline int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename T>
void rms_norm_rows(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor* residual,
                   const torch::Tensor* residual_out, const torch::Tensor& weight, float eps) {
  const int64_t cols = x.size(1);
  T* op = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* hp = residual_out ? residual_out->data_ptr<T>() : nullptr;
  at::parallel_for(0, x.size(0), grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<float> h(cols);
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * x.stride(0);
      if (rp) {  // h = x + residual, rounded as the unfused add stores it; it is the next residual stream
        const T* rr = rp + t * residual->stride(0);
        T* hr = hp + t * residual_out->stride(0);
        for (int64_t i = 0; i < cols; ++i) {
          const T sum = static_cast<T>(to_float(xr[i]) + to_float(rr[i]));
          hr[i] = sum;
          h[i] = to_float(sum);
        }
      } else {
        for (int64_t i = 0; i < cols; ++i) h[i] = to_float(xr[i]);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < cols; ++i) squares += h[i] * h[i];
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(cols) + eps);
      T* orow = op + t * out.stride(0);
      // weight * (h * rstd).to(dtype), each product rounded to the dtype
      for (int64_t i = 0; i < cols; ++i) orow[i] = static_cast<T>(to_float(wp[i]) * rounded<T>(h[i] * rstd));
    }
  });
}

// One head of one token: first half x1*cos - x2*sin, second half x2*cos + x1*sin, the tables rounded to
// the dtype and each product and sum rounded, as eager `x * cos + rotate_half(x) * sin` does.
template <typename T>
inline void rotate(T* p, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(p[i]), x2 = to_float(p[i + half]);
    const float a = rounded<T>(x1 * rounded<T>(cos[i])) - rounded<T>(x2 * rounded<T>(sin[i]));
    const float b = rounded<T>(x2 * rounded<T>(cos[i + half])) + rounded<T>(x1 * rounded<T>(sin[i + half]));
    p[i] = static_cast<T>(a);
    p[i + half] = static_cast<T>(b);
  }
}

template <typename T>
void rotary_rows(const torch::Tensor& q, const torch::Tensor& k, const int64_t* pos, const torch::Tensor& cos,
                 const torch::Tensor& sin) {
  const int64_t half = q.size(2) / 2;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, q.size(0), grain((q.size(1) + k.size(1)) * q.size(2)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * cos.stride(0);
      const float* s = sp + pos[t] * sin.stride(0);
      for (int64_t h = 0; h < q.size(1); ++h) rotate(qp + t * q.stride(0) + h * q.stride(1), c, s, half);
      for (int64_t h = 0; h < k.size(1); ++h) rotate(kp + t * k.stride(0) + h * k.stride(1), c, s, half);
    }
  });
}

// silu(g) = g / (1 + exp(-g)), rounded to the dtype, then times up, rounded: F.silu(gate) * up.
template <typename T>
void silu_and_mul_rows(const torch::Tensor& out, const torch::Tensor& gate_up) {
  const int64_t cols = out.size(1);
  T* op = out.data_ptr<T>();
  const T* gp = gate_up.data_ptr<T>();
  at::parallel_for(0, out.size(0), grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * gate_up.stride(0);
      const T* u = g + cols;
      T* o = op + t * out.stride(0);
      for (int64_t i = 0; i < cols; ++i) {
        const float x = to_float(g[i]);
        o[i] = static_cast<T>(rounded<T>(x / (1.f + fast_exp(-x))) * to_float(u[i]));
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == like.sizes() && t.stride(1) == 1 && t.scalar_type() == like.scalar_type(),
              name, " must be [T, H] like x, rows contiguous, same dtype");
}

}  // namespace

// out = RMSNorm(x) * weight; x, out: [T, H] (rows contiguous), weight [H].
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  check_rows(out, x, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [H], contiguous, the dtype of x");
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    rms_norm_rows<decltype(tag)>(out, x, nullptr, nullptr, weight, static_cast<float>(eps));
  });
}

// residual_out = x + residual; out = RMSNorm(residual_out) * weight.
void add_rms_norm(torch::Tensor out, torch::Tensor residual_out, torch::Tensor x, torch::Tensor residual,
                  torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  check_rows(out, x, "out");
  check_rows(residual, x, "residual");
  check_rows(residual_out, x, "residual_out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [H], contiguous, the dtype of x");
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    rms_norm_rows<decltype(tag)>(out, x, &residual, &residual_out, weight, static_cast<float>(eps));
  });
}

// Rotate q [T, Hq, D] and k [T, Hkv, D] (views into a fused QKV are fine) in place by the rows
// positions [T] (int64) of the float32 tables cos, sin [max_positions, D].
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2) && q.size(2) % 2 == 0,
              "q and k must be [T, H, D] with the same T and an even D");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.scalar_type() == k.scalar_type(),
              "q and k: head_dim contiguous, one dtype");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.dim() == 2 &&
                  sin.sizes() == cos.sizes() && cos.size(1) == q.size(2) && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin must be float32 [max_positions, D]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == q.size(0), "positions must be int64 [T]");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " is outside the rotary tables");
  dispatch_dtype(q.scalar_type(), [&](auto tag) { rotary_rows<decltype(tag)>(q, k, pp, cos, sin); });
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:].
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2I] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1) &&
                  out.stride(1) == 1 && out.scalar_type() == gate_up.scalar_type(),
              "out must be [T, I] with contiguous rows, the dtype of gate_up");
  dispatch_dtype(out.scalar_type(), [&](auto tag) { silu_and_mul_rows<decltype(tag)>(out, gate_up); });
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor residual, Tensor weight, "
        "float eps) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
