// LoRA deltas for one layer's output, every adapter's rows in one call: for each run of packed rows on
// one adapter (slot g), out[rows, col_t : col_t + W_t] += (x[rows] @ A[g])[:, c0_t : c0_t + R_t] @ B_t[g]
// for each target t that lives in this output (a fused q/k/v: three). A holds every target's A^T side by
// side with its scale folded in, so one shrink serves them all; B_t its B^T. Both are float32, whatever
// the activations' dtype (they are small, and a bfloat16 model then skips a conversion per use).
//
// Why not torch's GEMMs: a decode step's LoRA is ~5% of its linear FLOPs, but as torch calls it was
// hundreds of tiny GEMMs a step (rank-16 shrinks of ~40 rows), each paying dispatch and a thread
// barrier, and it cost a quarter of the step. Here a call is one parallel region over blocks of rows;
// a block keeps its shrink in registers and L1 and adds each expand straight into the output.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "common.h"

namespace {

constexpr int64_t kRows = 4;  // rows per block: each A or B vector loaded serves this many rows

#if defined(__AVX512F__)
// s[m][r0 : r0 + 16 NV] for the block's kRows rows: the accumulators stay in registers (compile-time
// loop bounds), each A vector loaded once for all the rows.
template <int NV>
void shrink_tile(const float* x, int64_t K, const float* a, int64_t R, int64_t r0, float* s) {
  __m512 acc[kRows][NV];
  for (int m = 0; m < kRows; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_ps(a + k * R + r0 + 16 * v);
    for (int m = 0; m < kRows; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(xv, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + m * R + r0 + 16 * v, acc[m][v]);
}
#endif

// s[m][0:R] = x[m][0:K] @ a[0:K][0:R] for the block's kRows rows (x's rows K floats apart, a's R).
void shrink(const float* x, int64_t K, const float* a, int64_t R, float* s) {
#if defined(__AVX512F__)
  if (R % 16 == 0) {
    int64_t r0 = 0;
    for (; r0 + 96 <= R; r0 += 96) shrink_tile<6>(x, K, a, R, r0, s);
    switch ((R - r0) / 16) {
      case 5: shrink_tile<5>(x, K, a, R, r0, s); break;
      case 4: shrink_tile<4>(x, K, a, R, r0, s); break;
      case 3: shrink_tile<3>(x, K, a, R, r0, s); break;
      case 2: shrink_tile<2>(x, K, a, R, r0, s); break;
      case 1: shrink_tile<1>(x, K, a, R, r0, s); break;
      default: break;
    }
    return;
  }
#endif
  for (int64_t m = 0; m < kRows; ++m) {
    float* sm = s + m * R;
    std::fill(sm, sm + R, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * K + k];
      for (int64_t r = 0; r < R; ++r) sm[r] = std::fma(xv, a[k * R + r], sm[r]);
    }
  }
}

// out[m][0:W] += s[m][0:rank] @ b[0:rank][0:W] for the block's first ``rows`` rows; s's rows are ld floats
// apart, out's ostride elements.
template <typename T>
void expand(const float* s, int64_t ld, int64_t rows, int64_t rank, const float* b, int64_t W, T* out,
            int64_t ostride) {
#if defined(__AVX512F__)
  for (int64_t n = 0; n < W; n += 64) {  // 4 vectors x kRows rows of accumulators; past W, lanes masked
    __mmask16 mask[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, W - n - 16 * v));
      mask[v] = static_cast<__mmask16>((1u << left) - 1u);
    }
    __m512 acc[kRows][4];
    for (int m = 0; m < kRows; ++m)
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      __m512 w[4];
      for (int v = 0; v < 4; ++v) w[v] = _mm512_maskz_loadu_ps(mask[v], b + r * W + n + 16 * v);
      for (int m = 0; m < kRows; ++m) {
        const __m512 sv = _mm512_set1_ps(s[m * ld + r]);
        for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_fmadd_ps(sv, w[v], acc[m][v]);
      }
    }
    alignas(64) float delta[kRows][64];
    for (int m = 0; m < kRows; ++m)
      for (int v = 0; v < 4; ++v) _mm512_store_ps(delta[m] + 16 * v, acc[m][v]);
    const int64_t width = std::min<int64_t>(64, W - n);
    for (int64_t m = 0; m < rows; ++m) {
      T* o = out + m * ostride + n;
      for (int64_t j = 0; j < width; ++j) o[j] = static_cast<T>(sluice_cpu::to_float(o[j]) + delta[m][j]);
    }
  }
#else
  std::vector<float> delta(W);
  for (int64_t m = 0; m < rows; ++m) {
    std::fill(delta.begin(), delta.end(), 0.f);
    for (int64_t r = 0; r < rank; ++r) {
      const float sv = s[m * ld + r];
      for (int64_t j = 0; j < W; ++j) delta[j] = std::fma(sv, b[r * W + j], delta[j]);
    }
    T* o = out + m * ostride;
    for (int64_t j = 0; j < W; ++j) o[j] = static_cast<T>(sluice_cpu::to_float(o[j]) + delta[j]);
  }
#endif
}

struct Block {
  int64_t row, rows, slot;  // the block's first packed row, how many, its adapter's slot
};

}  // namespace

// out [T, N] and x [T, K] (rows any distance apart, columns contiguous; float32, bfloat16 or float16);
// runs [n, 3] int64 (first row, end row, slot); a [G, K, R] float32 contiguous; per target: b [G, R_t, W_t]
// float32 contiguous, its first output column and its first column of the shrink.
void lora_add_(torch::Tensor out, torch::Tensor x, torch::Tensor runs, torch::Tensor a, at::TensorList b,
               at::IntArrayRef cols, at::IntArrayRef c0s) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && out.size(0) == x.size(0), "out [T, N] and x [T, K] expected");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "out and x need contiguous columns");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x must share a dtype");
  TORCH_CHECK(a.dim() == 3 && a.scalar_type() == torch::kFloat && a.is_contiguous() && a.size(1) == x.size(1),
              "a must be float32 [G, K, R], contiguous");
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3 && runs.scalar_type() == torch::kLong && runs.is_contiguous(),
              "runs must be int64 [n, 3]");
  TORCH_CHECK(b.size() == cols.size() && b.size() == c0s.size(), "one column and one shrink column per target");
  const int64_t G = a.size(0), K = a.size(1), R = a.size(2), T = x.size(0), N = out.size(1);
  for (size_t t = 0; t < b.size(); ++t) {
    TORCH_CHECK(b[t].dim() == 3 && b[t].scalar_type() == torch::kFloat && b[t].is_contiguous() && b[t].size(0) == G,
                "each b must be float32 [G, R_t, W_t], contiguous");
    TORCH_CHECK(c0s[t] >= 0 && c0s[t] + b[t].size(1) <= R && cols[t] >= 0 && cols[t] + b[t].size(2) <= N,
                "a target's columns lie outside the shrink or the output");
  }
  const int64_t* rp = runs.data_ptr<int64_t>();
  std::vector<Block> blocks;  // every run cut into blocks of kRows rows
  for (int64_t i = 0; i < runs.size(0); ++i) {
    const int64_t start = rp[3 * i], end = rp[3 * i + 1], slot = rp[3 * i + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= T && 0 <= slot && slot < G, "a run lies outside the batch");
    for (int64_t r = start; r < end; r += kRows) blocks.push_back({r, std::min(end, r + kRows) - r, slot});
  }
  const float* ap = a.data_ptr<float>();
  std::vector<const float*> bp;
  for (const auto& bt : b) bp.push_back(bt.data_ptr<float>());
  const int64_t xs = x.stride(0), os = out.stride(0);
  sluice_cpu::dispatch_dtype(x.scalar_type(), [&](auto zero) {
    using T_ = decltype(zero);
    const T_* xp = static_cast<const T_*>(x.data_ptr());
    T_* op = static_cast<T_*>(out.data_ptr());
    const int64_t work = K * R + 1;  // a block's shrink, in multiply-adds: blocks per task from it
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), std::max<int64_t>(1, 32768 / work),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> xf(kRows * K), s(kRows * R);
      for (int64_t i = begin; i < end; ++i) {
        const auto [row, rows, g] = blocks[i];
        for (int64_t m = 0; m < rows; ++m)  // a short block's missing rows stay zero
          for (int64_t k = 0; k < K; ++k) xf[m * K + k] = sluice_cpu::to_float(xp[(row + m) * xs + k]);
        if (rows < kRows) std::fill(xf.begin() + rows * K, xf.end(), 0.f);
        shrink(xf.data(), K, ap + g * K * R, R, s.data());
        if constexpr (!std::is_same_v<T_, float>)  // as a matmul in the activations' dtype rounds it
          for (int64_t j = 0; j < rows * R; ++j) s[j] = sluice_cpu::to_float(static_cast<T_>(s[j]));
        for (size_t t = 0; t < b.size(); ++t) {
          const int64_t rank = b[t].size(1), W = b[t].size(2);
          expand<T_>(s.data() + c0s[t], R, rows, rank, bp[t] + g * rank * W, W,
                     op + row * os + cols[t], os);
        }
      }
    });
  });
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor runs, Tensor a, Tensor[] b, int[] cols, int[] c0s) -> ()");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("lora_add_", &lora_add_); }
