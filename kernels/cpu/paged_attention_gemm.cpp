// Paged attention on the matrix units: a query tile's scores against a span of keys, and the
// probabilities times that span's values, are two small GEMMs run by oneDNN's batch-reduce GEMM
// micro-kernel (at::native::cpublas::brgemm): AMX tiles where the CPU has them, AVX512-BF16 / AVX-512
// FMA elsewhere. The vector kernel (paged_attention.cpp) does the same arithmetic one dot product at a time.
//
// One work item is (query tile, KV head), as in paged_attention.cpp: up to kRun consecutive query rows of
// one sequence (a decode is a tile of one) times the GQA group of query heads each row has on that KV
// head, M = rows x group GEMM rows. Per span of keys (whole blocks, up to kSpan) the tile computes
//   S [M, n] = Q [M, D] x K^T [D, n]       (K^T packed from the blocks: a transpose of 32-bit words)
//   online softmax per row of S, in float32, into P [M, n] (the stored dtype)
//   O [M, D] += P [M, n] x V [n, D]         (V in place in float32; in bfloat16, pairs of rows interleaved)
// Keys and values are read in their stored dtype, never converted to float32 first. bfloat16 B operands
// take oneDNN's VNNI layout (pairs along the summed dimension interleaved): for K^T that is the transpose
// of K's rows read as 32-bit words, the same transpose float32 needs.
//
// An int8 cache (engine/kv_quant.py) is dequantized a block at a time into a small scratch in T, then the same
// GEMMs run on it: the block's bytes still come from memory once per tile, at half the 16-bit size.
//
// A row's softmax sums the keys span by span here, in another order than the vector kernel's pieces of
// 16, so the two kernels agree within rounding, not to the bit.

#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "paged_plan.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

namespace cpublas = at::native::cpublas;
using sluice_cpu::fast_exp;
using sluice_cpu::Item;
using sluice_cpu::Unit;
using sluice_cpu::to_float;

constexpr int64_t kRun = 64;  // query rows per tile: M = 64 x group rows per GEMM (32: 5-10% slower)

// bfloat16 operands go to oneDNN in VNNI layout; float32 ones as they are.
template <typename T>
constexpr bool kVnni = std::is_same_v<T, at::BFloat16>;

// Keys per GEMM and softmax pass in bfloat16: whole blocks, about this many. A row's softmax has fixed costs
// per pass (its max and sum reduced across lanes, its output rescaled), which over one 32-key block took
// twice the two GEMMs' time; over 256 keys they are an eighth of that (bench/attention_micro.py
// --query-len 512). In float32 a span is one block: the value rows are then used where they lie, and
// oneDNN's float32 micro-kernel (no AMX) ran slower on wider spans.
template <typename T>
constexpr int64_t kSpan = kVnni<T> ? 256 : 1;

// Which dtypes the GEMM kernel takes here: float32 wherever oneDNN's micro-kernel runs (AVX2 and up),
// bfloat16 where it has a VNNI bfloat16 path (AVX-512 and up; AMX where present). Probed once by a tiny
// call, so a torch built without the micro-kernel (its fallback refuses VNNI) simply says no.
template <typename T>
bool probe() {
  try {
    T a[2 * 2] = {T(1.f), T(2.f), T(3.f), T(4.f)}, b[2 * 2] = {T(1.f), T(0.f), T(0.f), T(1.f)};
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    cpublas::brgemm(2, 2, 2, 2, 2, 2, false, a, b, c, kVnni<T>);
    cpublas::brgemm_release(kVnni<T>);
    // With VNNI, b is [K/2][N][2]: {1, 0, 0, 1} is B = [[1, 0], [0, 1]] either way.
    return c[0] == 1.f && c[1] == 2.f && c[2] == 3.f && c[3] == 4.f;
  } catch (const std::exception&) {
    return false;
  }
}

bool supported(at::ScalarType dtype) {
  static const bool f32 = probe<float>(), bf16 = probe<at::BFloat16>();
  return dtype == torch::kFloat ? f32 : dtype == torch::kBFloat16 ? bf16 : false;
}

// Per thread: the tile's packed Q, a span's K^T and V, scores, probabilities, output accumulator, softmax state.
template <typename T>
struct Scratch {
  std::vector<T> qa, kt, p, vp, kdq, vdq;  // kdq, vdq: an int8 block's keys and values, dequantized
  std::vector<float> s, acc, m, sum;
  std::vector<int64_t> lo, hi;  // each GEMM row's keys: [lo, hi)
  Scratch(int64_t rows, int64_t group, int64_t dim, int64_t block, int64_t span)
      : qa(rows * group * dim), kt((span + 1) * dim), p(rows * group * (span + 32)), vp((span + 32) * dim),
        kdq(block * dim), vdq(block * dim),
        s(rows * group * span), acc(rows * group * dim), m(rows * group), sum(rows * group), lo(rows * group),
        hi(rows * group) {}
};

// Q for the tile's M = count x group rows, [M, D] (row r's group heads are consecutive rows).
template <typename T>
void pack_q(T* qa, const T* qp, const Item* rows, int64_t count, int64_t group, int64_t h, int64_t dim,
            int64_t q_row, int64_t q_head) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t g = 0; g < group; ++g)
      std::copy_n(qp + rows[r].row * q_row + (h * group + g) * q_head, dim, qa + (r * group + g) * dim);
}

// A block's n keys as columns [col, col + n) of K^T, the B operand of Q x K^T: [D, ld] in float32,
// [D/2, ld, 2] (VNNI) in bfloat16. Either is the transpose of the rows read as 32-bit words (one float, or
// two adjacent bfloat16 of a row).
template <typename T>
void pack_kt(T* kt, int64_t ld, int64_t col, const T* k, int64_t k_tok, int64_t n, int64_t dim) {
  const int64_t words = dim * static_cast<int64_t>(sizeof(T)) / 4;
  auto* dst = reinterpret_cast<uint32_t*>(kt) + col;
  for (int64_t j = 0; j < n; ++j) {
    const auto* src = reinterpret_cast<const uint32_t*>(k + j * k_tok);
#pragma omp simd
    for (int64_t w = 0; w < words; ++w) dst[w * ld + j] = src[w];
  }
}

// V's n rows (stride v_tok) as the B operand of P x V in bfloat16: pairs of rows interleaved into
// [n2/2, D, 2], an odd last row paired with zeros.
inline void pack_v(at::BFloat16* vp, const at::BFloat16* v, int64_t v_tok, int64_t n, int64_t n2, int64_t dim) {
  const auto* src = reinterpret_cast<const uint16_t*>(v);
  auto* dst = reinterpret_cast<uint16_t*>(vp);
  for (int64_t j = 0; j < n2; j += 2) {
    const uint16_t* a = src + j * v_tok;
    const uint16_t* b = a + v_tok;
    uint16_t* out = dst + j * dim;
    if (j + 1 < n) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        out[2 * d] = a[d];
        out[2 * d + 1] = b[d];
      }
    } else {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        out[2 * d] = a[d];
        out[2 * d + 1] = 0;
      }
    }
  }
}

#if defined(__AVX512F__)
// Sixteen finite floats as bfloat16, rounded to nearest even as c10's conversion does (one instruction
// where the CPU has AVX512-BF16; none of these values is subnormal, which it would flush).
inline __m256i round_bf16(__m512 x) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
#endif
}
#endif

// n int8 cache rows (stride tok: dim values, then the row's scale) as n x dim values of T. It runs per tile and
// block, as often as the GEMMs: one element at a time (c10's bfloat16 conversion does not vectorize) it took
// as long as they did, and int8 prompt attention ran at half the 16-bit speed.
template <typename T>
void dequantize_block(T* dst, const int8_t* src, int64_t tok, int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* row = src + j * tok;
    const float scale = sluice_cpu::row_scale(row, dim);
    T* out = dst + j * dim;
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(scale);
    for (; d + 16 <= dim; d += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
      const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), vs);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(out + d, x);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), round_bf16(x));
      }
    }
#endif
    for (; d < dim; ++d) out[d] = static_cast<T>(static_cast<float>(row[d]) * scale);
  }
}

// The max of one row's scores s[lo, hi) times scale (> 0): the scores stay as they are. Soft-capped
// (Gemma 2), they are first replaced by cap * tanh(s * scale / cap) (and read with scale 1 after).
inline float row_max(float* s, int64_t lo, int64_t hi, float scale, float cap) {
  float mx = -INFINITY;
  if (cap > 0.f) {
    for (int64_t j = lo; j < hi; ++j) {
      s[j] = cap * std::tanh(s[j] * scale / cap);
      mx = std::max(mx, s[j]);
    }
    return mx;
  }
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = lo; j < hi; j += 16) {
    const __mmask16 keep = static_cast<__mmask16>(hi - j >= 16 ? 0xFFFFu : (1u << (hi - j)) - 1u);
    vmax = _mm512_mask_max_ps(vmax, keep, vmax, _mm512_maskz_loadu_ps(keep, s + j));
  }
  mx = _mm512_reduce_max_ps(vmax);
#else
  for (int64_t j = lo; j < hi; ++j) mx = std::max(mx, s[j]);
#endif
  return mx * scale;
}

// p[j] = exp(s[j] * scale - now) stored in T for j in [lo, hi), zero elsewhere in [0, n2); returns the sum
// of the stored (rounded) values, so that rounding P cancels out of the normalisation.
template <typename T>
inline float exp_row(const float* s, float scale, float now, int64_t lo, int64_t hi, int64_t n2, T* p) {
#if defined(__AVX512F__)
  __m512 total = _mm512_setzero_ps();
  const __m512 vnow = _mm512_set1_ps(now), vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n2; j += 16) {
    const int64_t a = std::max<int64_t>(lo - j, 0), b = std::min<int64_t>(hi - j, 16);
    const uint32_t below_b = b >= 16 ? 0xFFFFu : (b > 0 ? (1u << b) - 1u : 0u);
    const __mmask16 valid = static_cast<__mmask16>(below_b & ~((1u << std::min<int64_t>(a, 16)) - 1u));
    const __mmask16 store = static_cast<__mmask16>(n2 - j >= 16 ? 0xFFFFu : (1u << (n2 - j)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(valid, s + j);
    __m512 e = _mm512_maskz_mov_ps(valid, sluice_cpu::exp16(_mm512_fmsub_ps(x, vscale, vnow)));
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(p + j, store, e);
    } else {  // rounded (the values are finite); the sum adds the values as stored
      const __m256i b = round_bf16(e);
      _mm256_mask_storeu_epi16(p + j, store, b);
      e = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    }
    total = _mm512_add_ps(total, e);
  }
  return _mm512_reduce_add_ps(total);
#else
  float total = 0.f;
  for (int64_t j = 0; j < n2; ++j) {
    const T e = j >= lo && j < hi ? T(fast_exp(s[j] * scale - now)) : T(0.f);
    p[j] = e;
    total += to_float(e);
  }
  return total;
#endif
}

// The online softmax over one block's scores s [M, n] (keys t..t+n-1): each row's running max and sum,
// its output row rescaled when the max grows, and its probabilities written to p [M, n2] (zeros where a key
// is outside the row's range and in the padding columns).
template <typename T>
void softmax_block(Scratch<T>& sc, int64_t M, int64_t t, int64_t n, int64_t n2, int64_t dim, float scale, float cap) {
  for (int64_t row = 0; row < M; ++row) {
    const int64_t lo = std::max<int64_t>(sc.lo[row] - t, 0), hi = std::min<int64_t>(sc.hi[row] - t, n);
    T* p = sc.p.data() + row * n2;
    if (lo >= hi) {  // no key of this block for this row
      std::fill_n(p, n2, T(0.f));
      continue;
    }
    float* s = sc.s.data() + row * n;
    const float mx = row_max(s, lo, hi, scale, cap);
    const float old = sc.m[row], now = std::max(old, mx);
    if (now > old) {
      const float alpha = fast_exp(old - now);  // old == -inf: 0, and acc and sum are 0 anyway
      sc.sum[row] *= alpha;
      float* acc = sc.acc.data() + row * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
      sc.m[row] = now;
    }
    sc.sum[row] += exp_row(s, cap > 0.f ? 1.f : scale, now, lo, hi, n2, p);
  }
}

// T: the queries' and output's dtype; C: the cache's, T or int8_t.
template <typename T, typename C>
void attend(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const sluice_cpu::Plan& plan, double scale, int64_t window,
            double soft_cap) {
  constexpr bool quant = std::is_same_v<C, int8_t>;
  const int64_t num_q_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t k_head = k_cache.stride(0), k_block = k_cache.stride(1);
  const int64_t v_head = v_cache.stride(0), v_block = v_cache.stride(1);
  // The rows the GEMMs read: the cache's, or (int8) the scratch's, dim apart.
  const int64_t k_tok = quant ? dim : k_cache.stride(2), v_tok = quant ? dim : v_cache.stride(2);
  const int64_t table_row = block_tables.stride(0);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const auto& units = plan.units;
  const int64_t num_work = static_cast<int64_t>(units.size()) * num_kv_heads;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);

  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // (An odd block size would split a VNNI pair of value rows across two blocks: one block a span then.)
    const int64_t span = block_size % 2 ? block_size : std::max<int64_t>(1, kSpan<T> / block_size) * block_size;
    Scratch<T> sc(plan.max_rows, group, dim, block_size, span);
    int64_t i;
    while ((i = next.fetch_add(1, std::memory_order_relaxed)) < num_work) {
      const Unit& unit = units[i / num_kv_heads];
      const int64_t h = i % num_kv_heads;
      const Item* rows = plan.items.data() + unit.first;
      const int64_t count = unit.count, M = count * group;
      pack_q(sc.qa.data(), qp, rows, count, group, h, dim, q_row, q_head);
      std::fill_n(sc.acc.begin(), M * dim, 0.f);
      std::fill_n(sc.m.begin(), M, -INFINITY);
      std::fill_n(sc.sum.begin(), M, 0.f);
      for (int64_t r = 0; r < count; ++r)
        for (int64_t g = 0; g < group; ++g) {
          sc.lo[r * group + g] = window > 0 ? std::max<int64_t>(0, rows[r].pos - window + 1) : 0;
          sc.hi[r * group + g] = rows[r].pos + 1;
        }
      const int64_t first = sc.lo[0], last = rows[count - 1].pos;  // the tile's earliest and latest key
      const int32_t* table = tables + rows[0].seq * table_row;
      const C* k_base = kp + h * k_head;
      const C* v_base = vp + h * v_head;
      // Spans of whole blocks at multiples of the span (so a row's keys fall into the same spans, at the same
      // columns, in any tile: its result does not depend on the tile), packed block by block (an int8 block
      // dequantized first); then one GEMM, one softmax pass and one more GEMM over the span. Blocks before the
      // tile's first key are zeros: no row reads them, and a sliding window may have let them go.
      for (int64_t t = first - first % span; t <= last; t += span) {
        const int64_t n = std::min(span, last + 1 - t);
        // P x V's depth: in bfloat16, whole chunks of 32 keys (zeros past n), the matrix units' step: a
        // shorter last chunk is summed in another order, and a row's result would depend on its tile.
        const int64_t n2 = kVnni<T> ? (n + 31) / 32 * 32 : n;
        const T* v_span = nullptr;
        for (int64_t b = 0; b < n; b += block_size) {
          const int64_t nb = std::min(block_size, n - b);
          if (t + b + nb <= first) {
            for (int64_t w = 0; w < dim * static_cast<int64_t>(sizeof(T)) / 4; ++w)
              std::fill_n(reinterpret_cast<uint32_t*>(sc.kt.data()) + w * n + b, nb, 0u);
            std::fill_n(sc.vp.data() + b * dim, nb * dim, T(0.f));
            continue;
          }
          const int64_t block = table[(t + b) / block_size];
          const T* k;
          const T* v;
          if constexpr (quant) {
            dequantize_block(sc.kdq.data(), k_base + block * k_block, k_cache.stride(2), nb, dim);
            dequantize_block(sc.vdq.data(), v_base + block * v_block, v_cache.stride(2), nb, dim);
            k = sc.kdq.data();
            v = sc.vdq.data();
          } else {
            k = k_base + block * k_block;
            v = v_base + block * v_block;
          }
          pack_kt(sc.kt.data(), n, b, k, k_tok, nb, dim);
          if constexpr (kVnni<T>) {
            // Blocks hold an even number of keys except perhaps the span's last, so pairs stay within blocks.
            pack_v(sc.vp.data() + b * dim, v, v_tok, nb, nb + (nb & 1), dim);
          } else {
            v_span = v;  // float32: a span is one block
          }
        }
        cpublas::brgemm(M, n, dim, dim, n, n, false, sc.qa.data(), sc.kt.data(), sc.s.data(), kVnni<T>);
        softmax_block(sc, M, t, n, n2, dim, fscale, cap);
        if constexpr (kVnni<T>) {
          std::fill(sc.vp.begin() + (n + (n & 1)) * dim, sc.vp.begin() + n2 * dim, T(0.f));
          cpublas::brgemm(M, dim, n2, n2, dim, dim, true, sc.p.data(), sc.vp.data(), sc.acc.data(), true);
        } else {
          cpublas::brgemm(M, dim, n, n2, v_tok, dim, true, sc.p.data(), v_span, sc.acc.data(), false);
        }
      }
      for (int64_t r = 0; r < count; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t col = r * group + g;
          const float inv = 1.f / sc.sum[col];
          const float* a = sc.acc.data() + col * dim;
          T* dst = op + rows[r].row * o_row + (h * group + g) * o_head;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(a[d] * inv);
        }
    }
    cpublas::brgemm_release(kVnni<T>);
  });
}

}  // namespace

// The same arguments as paged_attention, plus min_rows: tiles of fewer GEMM rows (query rows x group) go
// to the vector kernel instead (a decode's few rows leave the matrix units mostly idle, and its key block
// would be packed for one use). Float32 or bfloat16, where gemm_attention_supports says so.
void paged_attention_gemm(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                          double scale, int64_t window, double soft_cap, int64_t min_rows) {
  sluice_cpu::check_paged_args(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens);
  TORCH_CHECK(supported(q.scalar_type()), "the GEMM attention kernel does not take ", q.scalar_type(), " here");
  TORCH_CHECK(q.size(2) % 2 == 0 && k_cache.size(2) <= 512, "head_dim must be even and blocks at most 512 keys");
  auto tables = block_tables.contiguous();
  const sluice_cpu::Plan plan =
      sluice_cpu::plan_units(query_start_loc.contiguous(), seq_lens.contiguous(), q.size(0), kRun);
  const int64_t group = q.size(1) / k_cache.size(0);
  sluice_cpu::Plan gemm{plan.items, {}, 1}, vector{plan.items, {}, 1};
  for (const Unit& u : plan.units) {
    sluice_cpu::Plan& to = u.count * group >= min_rows ? gemm : vector;
    to.units.push_back(u);
    to.max_rows = std::max(to.max_rows, u.count);
  }
  const bool quant = k_cache.scalar_type() == torch::kChar;
  if (!gemm.units.empty()) {
    if (q.scalar_type() == torch::kFloat)
      quant ? attend<float, int8_t>(out, q, k_cache, v_cache, tables, gemm, scale, window, soft_cap)
            : attend<float, float>(out, q, k_cache, v_cache, tables, gemm, scale, window, soft_cap);
    else
      quant ? attend<at::BFloat16, int8_t>(out, q, k_cache, v_cache, tables, gemm, scale, window, soft_cap)
            : attend<at::BFloat16, at::BFloat16>(out, q, k_cache, v_cache, tables, gemm, scale, window, soft_cap);
  }
  if (!vector.units.empty()) sluice_cpu::attend_vector(out, q, k_cache, v_cache, tables, vector, scale, window, soft_cap);
}

bool gemm_attention_supports(at::ScalarType dtype) { return supported(dtype); }

// Whether oneDNN runs bfloat16 GEMMs on AMX tiles here (it packs for them only then).
bool cpu_has_amx() { return cpublas::could_pack(torch::kBFloat16); }

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def(
      "paged_attention_gemm(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int window, float soft_cap, int min_rows) -> ()");
  m.def("gemm_attention_supports(ScalarType dtype) -> bool", &gemm_attention_supports);
  m.def("cpu_has_amx() -> bool", &cpu_has_amx);
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("paged_attention_gemm", &paged_attention_gemm); }
