// Paged attention on the CPU, reading K/V blocks where they lie in the cache.
//
// One work item is (query tile, KV head): up to 16 consecutive query rows of one sequence (a decode is a
// tile of one) and the GQA group of query heads each row has on that KV head. The tile walks its keys
// once, 16 at a time: each row scores the piece (16 keys per register), runs an online softmax (running
// max and sum per head, the output rescaled when the max grows), then adds the weighted values, all
// while the piece is in L1; so a key and value row comes from memory once per tile, not once per query
// row, and the cache is never copied. (Transposing each piece into float for the tile, so a row's
// scores need no horizontal sums, measured no faster: bench/attention_micro.py, issue 28.) Items run on
// torch's own thread pool with a shared counter, costliest first, because item costs vary with context
// length and a static split idles a core.
//
// Decodes (one query row per sequence) and prompt chunks (many) are the same loop: prefill and decode
// are not separate worlds here either.
//
// An int8 cache (--kv-cache-dtype int8; engine/kv_quant.py) is read as it lies: a key row's int8 values are
// widened to float for the dot product and its scale multiplies the score; a value row's scale multiplies
// its softmax weight before the weighted sum (after the weight entered the softmax's sum). No row is
// dequantized into memory, so a step reads about half the bytes of a 16-bit cache.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "common.h"
#include "paged_plan.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using sluice_cpu::fast_exp;
#if defined(__AVX512F__)
using sluice_cpu::exp16;
#endif
using sluice_cpu::Item;
using sluice_cpu::Unit;
using sluice_cpu::row_scale;
using sluice_cpu::to_float;

template <typename C>
constexpr bool kQuant = std::is_same_v<C, int8_t>;

// The online softmax for one head over one piece of n <= 16 scores: s[j] becomes exp(s[j] - m) with m the
// running max, raised first if the piece holds a larger score (then the sum and the head's accumulated
// output, dim floats, are rescaled to it). The sum is kept unnormalised; the output is divided at the end.
#if !defined(__AVX512F__)
inline void online_softmax(float* s, int64_t n, float& m, float& sum, float* acc, int64_t dim) {
  float mx = m;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  if (mx > m) {
    const float scale = fast_exp(m - mx);
    sum *= scale;
    for (int64_t d = 0; d < dim; ++d) acc[d] *= scale;
    m = mx;
  }
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = fast_exp(s[j] - m);
    sum += s[j];
  }
}
#endif

template <typename T>
inline void from_float(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Key and value rows as float vectors. With AVX-512 (compiled with -march=native on a machine that
// has it) one 16-float register per chunk of head_dim; the generic path below serves every other CPU.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Sixteen horizontal sums at once: r[j] = sum of the lanes of a[j]. A reduce per key (a shuffle tree
// each) costs more than the key's dot product; transposing while adding costs three ops per key.
inline __m512 hsum16(__m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xDD));
}

// scores[g * stride + j] = q_g . k_j for the n <= 16 rows of one block piece (q already scaled, in float).
// Rows past n repeat the last one and are dropped at the store: no branch in the unrolled loop.
template <int NC, typename T>
inline void block_scores16(const float* q, const T* k, int64_t k_tok, int64_t n, int64_t group, float* scores,
                           int64_t stride) {
  if constexpr (!std::is_same_v<T, float>) {
    if (group > 1) {  // widen the piece's key rows once for the GQA group's heads, not once per head (exact)
      alignas(64) float kf[16 * NC * 16];
      for (int64_t j = 0; j < 16; ++j) {
        const T* row = k + std::min(j, n - 1) * k_tok;
        for (int c = 0; c < NC; ++c) _mm512_store_ps(kf + (j * NC + c) * 16, load16(row + c * 16));
      }
      block_scores16<NC, float>(q, kf, NC * 16, n, group, scores, stride);
      return;
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + g * NC * 16 + c * 16);
    __m512 a[16];
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j) {
      const T* row = k + std::min(j, n - 1) * k_tok;
      a[j] = _mm512_mul_ps(qv[0], load16(row));
#pragma GCC unroll 8
      for (int c = 1; c < NC; ++c) a[j] = _mm512_fmadd_ps(qv[c], load16(row + c * 16), a[j]);
    }
    _mm512_mask_storeu_ps(scores + g * stride, keep, hsum16(a));
  }
}

inline void online_softmax(float* s, int64_t n, float& m, float& sum, float* acc, int64_t dim) {
  const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
  const __m512 x = _mm512_maskz_loadu_ps(keep, s);
  if (_mm512_mask_cmp_ps_mask(keep, x, _mm512_set1_ps(m), _CMP_GT_OQ)) {  // rare once past the first pieces
    const float mx = _mm512_mask_reduce_max_ps(keep, x);
    const float scale = fast_exp(m - mx);
    sum *= scale;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] *= scale;
    m = mx;
  }
  const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
  _mm512_storeu_ps(s, e);
  sum += _mm512_reduce_add_ps(e);
}

// acc_g += sum_j w[g * stride + j] * v_j over the n rows of one block piece, for G query heads at once: a
// compile-time G keeps the accumulators in registers (with a runtime count they live on the stack).
template <int NC, int G, typename T>
inline void block_values_g(const float* w, int64_t stride, const T* v, int64_t v_tok, int64_t n, float* acc) {
  __m512 a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * NC * 16 + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    const T* row = v + j * v_tok;
    __m512 vr[NC];
    for (int c = 0; c < NC; ++c) vr[c] = load16(row + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 wj = _mm512_set1_ps(w[g * stride + j]);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(wj, vr[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * NC * 16 + c * 16, a[g][c]);
}

// The group's heads in as few passes over the piece (in L1) as fit in 32 registers with the value row.
template <int NC, typename T>
inline void block_values(const float* w, int64_t stride, const T* v, int64_t v_tok, int64_t n, int64_t group,
                         float* acc) {
  constexpr int kMax = NC <= 4 ? 4 : (NC <= 8 ? 2 : 1);
  int64_t g = 0;
  for (; g + kMax <= group; g += kMax) block_values_g<NC, kMax>(w + g * stride, stride, v, v_tok, n, acc + g * NC * 16);
  switch (group - g) {
    case 3: block_values_g<NC, 3>(w + g * stride, stride, v, v_tok, n, acc + g * NC * 16); break;
    case 2: block_values_g<NC, 2>(w + g * stride, stride, v, v_tok, n, acc + g * NC * 16); break;
    case 1: block_values_g<NC, 1>(w + g * stride, stride, v, v_tok, n, acc + g * NC * 16); break;
    default: break;
  }
}
#endif

// The same for any head_dim and CPU (NC = 0).
template <int NC, typename T>
inline void block_scores_generic(const float* q, const T* k, int64_t k_tok, int64_t n, int64_t group, int64_t dim,
                                 float* scores, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t j = 0; j < n; ++j) {
      const T* row = k + j * k_tok;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += q[g * dim + d] * to_float(row[d]);
      scores[g * stride + j] = s;
    }
  }
}

template <int NC, typename T>
inline void block_values_generic(const float* w, int64_t stride, const T* v, int64_t v_tok, int64_t n, int64_t group,
                                 int64_t dim, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    float* a = acc + g * dim;
    for (int64_t j = 0; j < n; ++j) {
      const float wj = w[g * stride + j];
      const T* row = v + j * v_tok;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += wj * to_float(row[d]);
    }
  }
}

// Start fetching a piece before it is read: blocks lie wherever the allocator put them, so the hardware
// prefetcher, which follows a stream within a page, only meets each one at its first miss. Two lines
// are enough to set it going on the piece's page; a prefetch per line costs more than it saves
// (measured with bench/attention_micro.py).
template <typename T>
inline void start_fetch(const T* p) {
  __builtin_prefetch(p, 0, 2);
  __builtin_prefetch(reinterpret_cast<const char*>(p) + 64, 0, 2);
}

// Per thread: each tile row's scaled query, output accumulator and softmax state, and the piece's scores.
struct Scratch {
  std::vector<float> qf, acc, m, sum, w;
  Scratch(int64_t rows, int64_t group, int64_t dim, int64_t piece)
      : qf(rows * group * dim), acc(rows * group * dim), m(rows * group), sum(rows * group), w(group * piece) {}
};

// One row's heads, given the scores w[g * 16 + j] of n keys: soft-cap, online softmax, weighted values.
template <int NC, typename V>
inline void weigh_values(float* w, const V* v, int64_t v_tok, int64_t n, int64_t group, int64_t dim, float cap,
                         float* m, float* sum, float* acc) {
  constexpr int64_t kPiece = 16;
  for (int64_t g = 0; g < group; ++g) {
    float* s = w + g * kPiece;
    if (cap > 0.f)  // soft-capped scores, as Gemma 2 defines them
      for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] / cap);
    online_softmax(s, n, m[g], sum[g], acc + g * dim, dim);
  }
  if constexpr (kQuant<V>) {  // each value row's scale, folded into its weight once the sum has it
    float vs[kPiece];
    for (int64_t j = 0; j < n; ++j) vs[j] = row_scale(v + j * v_tok, dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) w[g * kPiece + j] *= vs[j];
  }
#if defined(__AVX512F__)
  if constexpr (NC > 0) block_values<NC>(w, kPiece, v, v_tok, n, group, acc);
  else
#endif
    block_values_generic<NC>(w, kPiece, v, v_tok, n, group, dim, acc);
}

// One row's heads over n keys of a piece: scores, then weigh_values.
template <int NC, typename K, typename V>
inline void attend_piece(const float* qf, const K* k, int64_t k_tok, const V* v, int64_t v_tok, int64_t n,
                         int64_t group, int64_t dim, float cap, float* w, float* m, float* sum, float* acc) {
  constexpr int64_t kPiece = 16;
#if defined(__AVX512F__)
  if constexpr (NC > 0) block_scores16<NC>(qf, k, k_tok, n, group, w, kPiece);
  else
#endif
    block_scores_generic<NC>(qf, k, k_tok, n, group, dim, w, kPiece);
  if constexpr (kQuant<K>) {  // each key row's scale times its scores
    float ks[kPiece];
    for (int64_t j = 0; j < n; ++j) ks[j] = row_scale(k + j * k_tok, dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < n; ++j) w[g * kPiece + j] *= ks[j];
  }
  weigh_values<NC>(w, v, v_tok, n, group, dim, cap, m, sum, acc);
}

// Query tiling: the tile walks its keys once, 16 at a time, and every row of the tile uses each piece
// while it is in L1, so a long prompt chunk reads each key and value row from memory once per tile
// rather than once per query row. Each row keeps to its own keys: (pos - window, pos] (the causal edge
// and a sliding window cut a piece short per row). A row's pieces and arithmetic are the same in any
// tile, so its result is the same to the bit as a tile of one (a decode): a prompt's output does not
// depend on how the scheduler chunked it or what shared its step.
// T: the queries' and output's dtype; C: the cache's, T or int8_t.
template <int NC, typename T, typename C>
void attend(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const std::vector<Item>& items, const std::vector<Unit>& units,
            int64_t max_rows, double scale, int64_t window, double soft_cap) {
  const int64_t num_q_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t k_head = k_cache.stride(0), k_block = k_cache.stride(1), k_tok = k_cache.stride(2);
  const int64_t v_head = v_cache.stride(0), v_block = v_cache.stride(1), v_tok = v_cache.stride(2);
  const int64_t table_row = block_tables.stride(0);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t num_work = static_cast<int64_t>(units.size()) * num_kv_heads;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const int64_t gd = group * dim;

  constexpr int64_t kPiece = 16;  // keys scored and weighed together: one register of scores per head
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch sc(max_rows, group, dim, kPiece);
    int64_t i;
    while ((i = next.fetch_add(1, std::memory_order_relaxed)) < num_work) {
      const Unit& unit = units[i / num_kv_heads];
      const int64_t h = i % num_kv_heads;
      const Item* rows = items.data() + unit.first;
      const int64_t count = unit.count;
      for (int64_t r = 0; r < count; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + rows[r].row * q_row + (h * group + g) * q_head;
          for (int64_t d = 0; d < dim; ++d) sc.qf[r * gd + g * dim + d] = to_float(src[d]) * fscale;
        }
      }
      std::fill_n(sc.acc.begin(), count * gd, 0.f);
      std::fill_n(sc.m.begin(), count * group, -INFINITY);
      std::fill_n(sc.sum.begin(), count * group, 0.f);
      // A tile's rows are consecutive positions of one sequence: the first row sees the earliest key,
      // the last row the latest.
      const int64_t last = rows[count - 1].pos;
      auto first_key = [&](int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; };
      const int32_t* table = tables + rows[0].seq * table_row;
      const C* k_base = kp + h * k_head;
      const C* v_base = vp + h * v_head;
      for (int64_t t = first_key(rows[0].pos); t <= last;) {
        // Pieces end at multiples of 16 keys and at block ends, whichever row walks them: a row's pieces,
        // and so its softmax's rounding, do not depend on the tile it is in.
        const int64_t off = t % block_size;
        const int64_t n = std::min({kPiece - t % kPiece, block_size - off, last + 1 - t});
        const int64_t block = table[t / block_size];
        if (t + n <= last) {  // the next piece's keys and values
          const int64_t b = table[(t + n) / block_size], o = (t + n) % block_size;
          start_fetch(k_base + b * k_block + o * k_tok);
          start_fetch(v_base + b * v_block + o * v_tok);
        }
        const C* k = k_base + block * k_block + off * k_tok;
        const C* v = v_base + block * v_block + off * v_tok;
        for (int64_t r = 0; r < count; ++r) {
          const int64_t lo = std::max(t, first_key(rows[r].pos)), hi = std::min(t + n, rows[r].pos + 1);
          if (lo >= hi) continue;  // past this row's causal edge, or before its window
          float* m = sc.m.data() + r * group;
          float* sum = sc.sum.data() + r * group;
          float* acc = sc.acc.data() + r * gd;
          attend_piece<NC>(sc.qf.data() + r * gd, k + (lo - t) * k_tok, k_tok, v + (lo - t) * v_tok, v_tok, hi - lo,
                           group, dim, cap, sc.w.data(), m, sum, acc);
        }
        t += n;
      }
      for (int64_t r = 0; r < count; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          float* a = sc.acc.data() + r * gd + g * dim;
          const float s = sc.sum[r * group + g];
          for (int64_t d = 0; d < dim; ++d) a[d] /= s;
          from_float(op + rows[r].row * o_row + (h * group + g) * o_head, a, dim);
        }
      }
    }
  });
}

}  // namespace

namespace sluice_cpu {

void attend_vector(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& tables, const Plan& plan, double scale,
                   int64_t window, double soft_cap) {
  const int64_t dim = q.size(2);
  auto with_cache = [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    if (dim == 64)
      attend<4, T, C>(out, q, k_cache, v_cache, tables, plan.items, plan.units, plan.max_rows, scale, window, soft_cap);
    else if (dim == 128)
      attend<8, T, C>(out, q, k_cache, v_cache, tables, plan.items, plan.units, plan.max_rows, scale, window, soft_cap);
    else
      attend<0, T, C>(out, q, k_cache, v_cache, tables, plan.items, plan.units, plan.max_rows, scale, window, soft_cap);
  };
  const bool quant = k_cache.scalar_type() == torch::kChar;
  dispatch_dtype(q.scalar_type(), [&](auto tag) {
    if (quant)
      with_cache(tag, int8_t{});
    else
      with_cache(tag, tag);
  });
}

}  // namespace sluice_cpu

// out, q: [T, Hq, D]; caches head-major [Hkv, num_blocks, block_size, D]; block_tables [B, W] int32;
// query_start_loc [B + 1] int32; seq_lens [B] int32. window <= 0: none; soft_cap <= 0: none.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                     int64_t window, double soft_cap) {
  sluice_cpu::check_paged_args(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens);
  // Prompt chunks in tiles of 16 rows; costliest first, so the last units handed out are the cheap ones.
  const sluice_cpu::Plan plan =
      sluice_cpu::plan_units(query_start_loc.contiguous(), seq_lens.contiguous(), q.size(0), 16);
  sluice_cpu::attend_vector(out, q, k_cache, v_cache, block_tables.contiguous(), plan, scale, window, soft_cap);
}

// A torch op (torch.ops.sluice.paged_attention), so profilers and torch.compile see it by name.
TORCH_LIBRARY(sluice, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int window, float soft_cap) -> ()");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("paged_attention", &paged_attention); }
