// Write a step's new keys and values into their cache slots (head-major caches, slot -1 = skip).
//
// The PyTorch version is a mask, a check and two index_copy calls per layer; at decode sizes those
// calls, not the bytes (a few hundred KiB), are the cost.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"

namespace {

using sluice_cpu::kScaleBytes;
using sluice_cpu::to_float;

// One row quantized into an int8 cache row: dim values, then their float32 scale (engine/kv_quant.py).
// Float32 division and round-half-to-even, as quantize_rows does, so both write the same bytes.
template <typename T>
void quantize_row(const T* x, int8_t* dst, int64_t dim) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const float scale = amax / 127.f;
  const float div = scale > 0.f ? scale : 1.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float q = std::nearbyint(to_float(x[d]) / div);
    dst[d] = static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
  }
  std::memcpy(dst + dim, &scale, kScaleBytes);
}

template <typename T>
void quantize_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t begin, int64_t end) {
  const int64_t heads = cache.size(0), block_size = cache.size(2), dim = src.size(2);
  const T* s = src.data_ptr<T>();
  int8_t* c = cache.data_ptr<int8_t>();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int64_t h = 0; h < heads; ++h)
      quantize_row(s + t * src.stride(0) + h * src.stride(1),
                   c + h * cache.stride(0) + block * cache.stride(1) + off * cache.stride(2), dim);
  }
}

void copy_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t begin, int64_t end) {
  const int64_t heads = cache.size(0), block_size = cache.size(2);
  const int64_t bytes = cache.size(3) * cache.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* c = static_cast<char*>(cache.data_ptr());
  const int64_t es = src.element_size();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, off = slot % block_size;
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(c + (h * cache.stride(0) + block * cache.stride(1) + off * cache.stride(2)) * es,
                  s + (t * src.stride(0) + h * src.stride(1)) * es, bytes);
  }
}

}  // namespace

// k, v: [T, Hkv, D]; caches [Hkv, num_blocks, block_size, D] in k's dtype, or int8 [.., D + kScaleBytes]
// (quantized here); slot_mapping [T] int64.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [T, Hkv, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [Hkv, blocks, block, D]");
  const bool quant = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(k.size(1) == k_cache.size(0) && k.size(2) + (quant ? kScaleBytes : 0) == k_cache.size(3),
              "k/v and cache shapes differ");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (quant || k.scalar_type() == k_cache.scalar_type()),
              "dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64 [T]");
  auto slots = slot_mapping.contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < k.size(0); ++t) TORCH_CHECK(s[t] < capacity, "slot ", s[t], " is outside the cache");
  if (quant) {
    sluice_cpu::dispatch_dtype(k.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      at::parallel_for(0, k.size(0), 16, [&](int64_t begin, int64_t end) {
        quantize_rows<T>(k, k_cache, s, begin, end);
        quantize_rows<T>(v, v_cache, s, begin, end);
      });
    });
    return;
  }
  at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
    copy_rows(k, k_cache, s, begin, end);
    copy_rows(v, v_cache, s, begin, end);
  });
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("store_kv", &store_kv); }
