// Sampling's two passes over the vocabulary (engine/sampler.py): each row's k largest logits, and the sums
// of exp((x - shift) * inv_t) over blocks of a row. In PyTorch the first is topk (a copy of the row as
// (value, index) pairs, then a partial sort) and the second three passes over an [N, V] temporary
// (50 MB at batch 256, fresh pages every step); here each is one read of the row, rows on all threads.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

struct Cand {
  float v;
  int64_t i;
};

// Larger value first; of equal values the lower id (torch's topk leaves ties in no stated order).
inline bool before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

// The k largest of x[0, n) into buf (sorted), a buffer that grows to at most 2k + 16 entries.
void row_topk(const float* x, int64_t n, int64_t k, std::vector<Cand>& buf) {
  buf.clear();
  const size_t cap = static_cast<size_t>(2 * k + 16);
  float thr = -INFINITY;  // once the buffer has been cut to k: the k-th largest, below which nothing enters
  bool cut = false;
  auto push = [&](int64_t i) {
    if (cut && !(x[i] > thr)) return;  // equal to the k-th: a later id loses the tie
    buf.push_back({x[i], i});
    if (buf.size() >= cap) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), before);
      buf.resize(k);
      thr = buf[k - 1].v;
      cut = true;
    }
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    // Until the first cut every value enters (-inf included, as torch's topk returns them).
    __mmask16 m = cut ? _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(thr), _CMP_GT_OQ) : 0xFFFF;
    while (m) {
      push(i + __builtin_ctz(m));
      m &= m - 1;
    }
  }
#endif
  for (; i < n; ++i) push(i);
  const int64_t keep = std::min<int64_t>(k, static_cast<int64_t>(buf.size()));
  std::partial_sort(buf.begin(), buf.begin() + keep, buf.end(), before);
  buf.resize(keep);
}

void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
}

}  // namespace

// logits [N, V] float32 -> (values [N, k] float32, ids [N, k] int64), each row in descending order.
std::tuple<torch::Tensor, torch::Tensor> topk_rows(torch::Tensor logits, int64_t k) {
  check_logits(logits);
  TORCH_CHECK(k >= 1 && k <= logits.size(1), "k must be in [1, V]");
  auto values = torch::empty({logits.size(0), k}, logits.options());
  auto ids = torch::empty({logits.size(0), k}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  float* vo = values.data_ptr<float>();
  int64_t* io = ids.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0), n = logits.size(1);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<Cand> buf;
    buf.reserve(2 * k + 16);
    for (int64_t r = begin; r < end; ++r) {
      row_topk(x + r * stride, n, k, buf);
      for (int64_t j = 0; j < k; ++j) {
        vo[r * k + j] = buf[j].v;
        io[r * k + j] = buf[j].i;
      }
    }
  });
  return {values, ids};
}

// logits [N, V] float32, shift and inv_t [N] float32 -> [N, ceil(V / block)] float64: block b of row r is
// the sum of exp((x - shift[r]) * inv_t[r]) over columns [b * block, (b + 1) * block). Each block is summed
// in 16 float lanes (it holds at most a few hundred terms of at most 1 each when shift is the row's max),
// then in double.
torch::Tensor exp_block_sums(torch::Tensor logits, torch::Tensor shift, torch::Tensor inv_t, int64_t block) {
  check_logits(logits);
  TORCH_CHECK(shift.scalar_type() == torch::kFloat && inv_t.scalar_type() == torch::kFloat &&
                  shift.numel() == logits.size(0) && inv_t.numel() == logits.size(0),
              "shift and inv_t must be float32 [N]");
  TORCH_CHECK(block >= 16 && block % 16 == 0, "block must be a positive multiple of 16");
  auto sh = shift.contiguous(), it = inv_t.contiguous();
  const int64_t n = logits.size(1), blocks = (n + block - 1) / block, stride = logits.stride(0);
  auto out = torch::empty({logits.size(0), blocks}, logits.options().dtype(torch::kDouble));
  const float* x = logits.data_ptr<float>();
  const float* shp = sh.data_ptr<float>();
  const float* itp = it.data_ptr<float>();
  double* o = out.data_ptr<double>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      const float s = shp[r], t = itp[r];
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t lo = b * block, hi = std::min(n, lo + block);
        float acc[16] = {};
        int64_t i = lo;
        for (; i + 16 <= hi; i += 16)
          for (int l = 0; l < 16; ++l) {
            const float v = (row[i + l] - s) * t;
            acc[l] += v > -87.f ? sluice_cpu::fast_exp(v) : 0.f;  // fast_exp stops at e^-87; -inf adds 0
          }
        double total = 0;
        for (; i < hi; ++i) {
          const float v = (row[i] - s) * t;
          total += v > -87.f ? sluice_cpu::fast_exp(v) : 0.f;
        }
        for (int l = 0; l < 16; ++l) total += acc[l];
        o[r * blocks + b] = total;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("topk_rows(Tensor logits, int k) -> (Tensor, Tensor)");
  m.def("exp_block_sums(Tensor logits, Tensor shift, Tensor inv_t, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("topk_rows", &topk_rows);
  m.impl("exp_block_sums", &exp_block_sums);
}
