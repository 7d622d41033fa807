// How a paged-attention step is cut into work: each query row (an Item) and tiles of consecutive rows of
// one sequence (Units), costliest first. Both attention kernels (paged_attention.cpp on the vector units,
// paged_attention_gemm.cpp on the matrix units) hand Units x KV heads to threads through a shared counter,
// because item costs vary with context length and a static split idles a core.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace sluice_cpu {

struct Item {
  int64_t row;  // query row in the packed step
  int64_t seq;  // sequence it belongs to
  int64_t pos;  // its position in the sequence
};

// A tile of consecutive query rows of one sequence, attended together on one thread for one KV head.
struct Unit {
  int64_t first;  // index of its first item
  int64_t count;
  int64_t cost;  // keys read, to hand out the costly units first
};

struct Plan {
  std::vector<Item> items;
  std::vector<Unit> units;
  int64_t max_rows = 1;
};

// query_start_loc [B + 1] and seq_lens [B], int32 and contiguous; prompt chunks in runs of up to `run` rows.
inline Plan plan_units(const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens, int64_t total_rows,
                       int64_t run) {
  const int32_t* qs = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  Plan plan;
  plan.items.reserve(total_rows);
  for (int64_t b = 0; b < seq_lens.size(0); ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    for (int64_t j = 0; j < q_len; ++j) plan.items.push_back({qs[b] + j, b, sl[b] - q_len + j});
  }
  for (int64_t b = 0, first = 0; b < seq_lens.size(0); ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    for (int64_t j = 0; j < q_len; j += run) {
      const int64_t count = std::min(run, q_len - j);
      int64_t cost = 0;
      for (int64_t r = first + j; r < first + j + count; ++r) cost += plan.items[r].pos + 1;
      plan.units.push_back({first + j, count, cost});
      plan.max_rows = std::max(plan.max_rows, count);
    }
    first += q_len;
  }
  std::stable_sort(plan.units.begin(), plan.units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  return plan;
}

// The arguments both kernels check the same way.
inline void check_paged_args(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [Hkv, blocks, block, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be contiguous");
  // An int8 cache's rows carry their scale after the head_dim values (engine/kv_quant.py).
  const bool quant = k_cache.scalar_type() == torch::kChar && v_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(q.size(2) + (quant ? kScaleBytes : 0) == k_cache.size(3) && q.size(2) <= 512,
              "head_dim mismatch or above 512");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK((quant || (q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type())) &&
                  q.scalar_type() == out.scalar_type(),
              "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && query_start_loc.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "block_tables, query_start_loc and seq_lens must be int32");
}

// The vector kernel (paged_attention.cpp) over a plan's units; the GEMM kernel hands it the tiles too
// small for the matrix units.
void attend_vector(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& tables, const Plan& plan, double scale,
                   int64_t window, double soft_cap);

}  // namespace sluice_cpu
