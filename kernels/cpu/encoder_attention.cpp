// Non-causal attention for an encoder's right-padded batch, float32, on the CPU: sequence b attends over
// its own lengths[b] keys only, so padding costs neither score nor softmax work, and no mask is read.
//
// Sequences of an embedding batch are short (all-MiniLM-L6-v2: <= 256 tokens, head_dim 32), so one
// (sequence, head)'s K^T and a few rows of scores sit in L1/L2: each task copies K^T once, then per block
// of R query rows computes the scores as a register-blocked GEMM (R rows x 16 keys), the exact softmax
// over the row, and P.V (R rows x head_dim). Tasks run in parallel over (sequence, head). q, k and v are
// read through their strides (views into the projections' [B, S, H, D] outputs: no copy, no transpose),
// and out is written as [B, S, H, D], which the output projection reads as [B, S, H * D] unchanged.
// Query rows past a sequence's length are written as zeros (nothing pools them).

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

#if defined(__AVX512F__)
using sluice_cpu::exp16;

struct View {  // a [B, S, H, D] tensor's data and strides (the last stride is 1)
  float* data;
  int64_t sb, ss, sh;
  explicit View(const torch::Tensor& t)
      : data(t.data_ptr<float>()), sb(t.stride(0)), ss(t.stride(1)), sh(t.stride(2)) {}
  float* row(int64_t b, int64_t s, int64_t h) const { return data + b * sb + s * ss + h * sh; }
};

// One (sequence, head): NC = head_dim / 16 vectors per row, R query rows per block (R * NC accumulators).
template <int NC, int R>
void attend_one(const View& out, const View& q, const View& k, const View& v, int64_t b, int64_t h,
                int64_t len, int64_t padded_len, float scale, std::vector<float>& kt, std::vector<float>& scores) {
  constexpr int64_t D = NC * 16;
  const int64_t lp = (len + 15) / 16 * 16;  // score row width: whole vectors, the tail masked
  kt.assign(D * lp, 0.f);
  scores.resize(R * lp);
  for (int64_t j = 0; j < len; ++j) {
    const float* kr = k.row(b, j, h);
    for (int64_t d = 0; d < D; ++d) kt[d * lp + j] = kr[d];
  }
  const __mmask16 tail = static_cast<__mmask16>(len % 16 ? (1u << (len % 16)) - 1u : 0xFFFFu);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < len; i0 += R) {
    const int64_t rows = std::min<int64_t>(R, len - i0);
    const float* qr[R];
    for (int r = 0; r < R; ++r) qr[r] = q.row(b, i0 + std::min<int64_t>(r, rows - 1), h);  // extra rows repeat
    // scores[r][j] = q_r . k_j, 16 keys at a time
    for (int64_t jb = 0; jb < lp; jb += 16) {
      __m512 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      const float* kc = kt.data() + jb;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kv = _mm512_loadu_ps(kc + d * lp);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kv, acc[r]);
      }
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores.data() + r * lp + jb, acc[r]);
    }
    // the row's exact softmax, left unnormalised: exp(scale * (s - max)); 1 / sum applied to the output
    float inv_sum[R];
    for (int r = 0; r < rows; ++r) {
      float* s = scores.data() + r * lp;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t jb = 0; jb < lp; jb += 16) {
        const __mmask16 keep = jb + 16 <= len ? 0xFFFF : tail;
        mx = _mm512_mask_max_ps(mx, keep, mx, _mm512_loadu_ps(s + jb));
      }
      const __m512 shift = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), vscale);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t jb = 0; jb < lp; jb += 16) {
        const __mmask16 keep = jb + 16 <= len ? 0xFFFF : tail;
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + jb), vscale, shift)));
        _mm512_storeu_ps(s + jb, e);
        sum = _mm512_add_ps(sum, e);
      }
      inv_sum[r] = 1.f / _mm512_reduce_add_ps(sum);
    }
    // out_r = sum_j p[r][j] * v_j
    __m512 acc[R][NC];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const float* vr = v.row(b, j, h);
      __m512 vj[NC];
      for (int c = 0; c < NC; ++c) vj[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(scores[r * lp + j]);
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(p, vj[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      float* o = out.row(b, i0 + r, h);
      const __m512 w = _mm512_set1_ps(inv_sum[r]);
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[r][c], w));
    }
  }
  for (int64_t i = len; i < padded_len; ++i) std::fill_n(out.row(b, i, h), D, 0.f);
}

template <int NC, int R>
void attend_all(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const int64_t* lengths, float scale) {
  const View vo(out), vq(q), vk(k), vv(v);
  const int64_t batch = q.size(0), seq = q.size(1), heads = q.size(2);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, scores;
    for (int64_t t = begin; t < end; ++t)
      attend_one<NC, R>(vo, vq, vk, vv, t / heads, t % heads, lengths[t / heads], seq, scale, kt, scores);
  });
}
#endif

bool supported(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
#else
  return false;  // the caller uses PyTorch's SDPA instead
#endif
}

void check_view(const torch::Tensor& t, const torch::Tensor& q, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.sizes() == q.sizes(), name, " must be [batch, seq, heads, head_dim] like q");
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.stride(3) == 1, name, " must be float32 with unit last stride");
}

}  // namespace

bool encoder_attention_supports(int64_t head_dim) { return supported(head_dim); }

void encoder_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor lengths,
                       double scale) {
  check_view(q, q, "q");
  check_view(k, q, "k");
  check_view(v, q, "v");
  check_view(out, q, "out");
  TORCH_CHECK(supported(q.size(3)), "encoder_attention: head_dim ", q.size(3), " not supported in this build");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.scalar_type() == torch::kLong &&
                  lengths.is_contiguous(), "lengths must be int64 [batch]");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= q.size(1), "lengths[", b, "] = ", lp[b], " is outside [1, ", q.size(1), "]");
#if defined(__AVX512F__)
  const float s = static_cast<float>(scale);
  switch (q.size(3)) {
    case 16: attend_all<1, 16>(out, q, k, v, lp, s); break;
    case 32: attend_all<2, 8>(out, q, k, v, lp, s); break;
    case 64: attend_all<4, 4>(out, q, k, v, lp, s); break;
    default: attend_all<8, 2>(out, q, k, v, lp, s); break;
  }
#endif
}

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("encoder_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> ()");
  m.def("encoder_attention_supports(int head_dim) -> bool", &encoder_attention_supports);  // no tensor: catch-all
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("encoder_attention", &encoder_attention); }
