// Decode attention over MLA latents on a CPU with AVX-512 (seekforge/model/kernels.py builds and loads it).
//
// One sequence's M query rows (its heads: MLA's heads share their keys and values, the latents) attend to its
// first `length` latent rows [c_kv | k_pe] (D wide); the values are the first R columns (c_kv). Per sequence:
// the M x length scores (two latent rows at a time against every query row, fp32 accumulators), a softmax
// per row, then the weighted sum (32 columns at a time, every query row), so each latent row is read from
// memory once and stays in the caches for both passes. Sequences are split over the threads, and with fewer
// sequences than threads each sequence's latents too (MIN_PART_ROWS). bf16 latents are widened to fp32 as they are
// loaded; all arithmetic is fp32.
//
// PyTorch's flash kernel runs the same shapes as two small GEMM calls per sequence (M = 8 rows for the
// `small` preset), whose per-call costs dominate at decode sizes; see kernels.py for the measurements.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "c_shims.h"
#include "vectors.h"

namespace {

using seekforge_vectors::columns;
using seekforge_vectors::load16;

// e^x for x <= 0 (softmax after the max is taken off): 2^n · p(r), r = x - n·ln2 in [-ln2/2, ln2/2]
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The scores pass reads the latents first, and in a decode step they come from memory: the weights' stream since the
// last step has pushed them out of every cache. The hardware prefetcher, which sees two short streams per pair of
// rows, fetched too little: a batch-1 step at 4,096 tokens of context (kv_lora_rank 512, bf16) took 19.3 ms, 8.4 ms
// with the rows PREFETCH_ROWS ahead requested as each pair is read (attention is most of such a step).
constexpr int64_t PREFETCH_ROWS = 16;

// scores[m, s] = q[m] · lat[s] · scale for MB query rows and the S latent rows, two rows at a time
template <int MB, typename T>
void scores_block(const float* q, const T* lat, int64_t ld, int64_t S, int64_t D, float scale, float* scores,
                  int64_t sld) {
  int64_t s = 0;
  for (; s + 2 <= S; s += 2) {
    __m512 a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    const T* l0 = lat + s * ld;
    const T* l1 = l0 + ld;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 k = columns(d, D);
      if (s + PREFETCH_ROWS + 1 < S) {  // see PREFETCH_ROWS
        _mm_prefetch(reinterpret_cast<const char*>(l0 + PREFETCH_ROWS * ld + d), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(l1 + PREFETCH_ROWS * ld + d), _MM_HINT_T0);
      }
      const __m512 x0 = load16(l0 + d, k), x1 = load16(l1 + d, k);
      for (int m = 0; m < MB; ++m) {
        const __m512 qv = _mm512_maskz_loadu_ps(k, q + m * D + d);
        a0[m] = _mm512_fmadd_ps(qv, x0, a0[m]);
        a1[m] = _mm512_fmadd_ps(qv, x1, a1[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      scores[m * sld + s] = _mm512_reduce_add_ps(a0[m]) * scale;
      scores[m * sld + s + 1] = _mm512_reduce_add_ps(a1[m]) * scale;
    }
  }
  for (; s < S; ++s) {
    __m512 a0[MB];
    for (int m = 0; m < MB; ++m) a0[m] = _mm512_setzero_ps();
    const T* l0 = lat + s * ld;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 k = columns(d, D);
      const __m512 x0 = load16(l0 + d, k);
      for (int m = 0; m < MB; ++m) a0[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, q + m * D + d), x0, a0[m]);
    }
    for (int m = 0; m < MB; ++m) scores[m * sld + s] = _mm512_reduce_add_ps(a0[m]) * scale;
  }
}

// out[m, :R] = Σ_s p[m, s] · lat[s, :R] for MB rows, 32 columns at a time
template <int MB, typename T>
void weighted_sum_block(const float* p, int64_t pld, const T* lat, int64_t ld, int64_t S, int64_t R, float* out) {
  for (int64_t d = 0; d < R; d += 32) {
    const __mmask16 k0 = columns(d, R), k1 = d + 16 < R ? columns(d + 16, R) : __mmask16(0);
    __m512 a0[MB], a1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const T* l = lat + s * ld + d;
      const __m512 x0 = load16(l, k0), x1 = load16(l + 16, k1);
      for (int m = 0; m < MB; ++m) {
        const __m512 w = _mm512_set1_ps(p[m * pld + s]);
        a0[m] = _mm512_fmadd_ps(w, x0, a0[m]);
        a1[m] = _mm512_fmadd_ps(w, x1, a1[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      _mm512_mask_storeu_ps(out + m * R + d, k0, a0[m]);
      _mm512_mask_storeu_ps(out + m * R + d + 16, k1, a1[m]);
    }
  }
}

// each of the M rows of S scores → exp(score - the row's max), in place; stats[2m], stats[2m + 1]: row m's max and
// the sum of its exps
void exp_rows(float* scores, int64_t M, int64_t S, float* stats) {
  for (int64_t m = 0; m < M; ++m) {
    float* x = scores + m * S;
    float mx = -INFINITY;
    for (int64_t s = 0; s < S; ++s) mx = std::max(mx, x[s]);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + 16 <= S; s += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + s), vmx));
      _mm512_storeu_ps(x + s, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (s < S) {
      const __mmask16 k = columns(s, S);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + s), vmx));
      _mm512_mask_storeu_ps(x + s, k, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
    }
    stats[2 * m] = mx;
    stats[2 * m + 1] = _mm512_reduce_add_ps(vsum);
  }
}

// M query rows attend to the S latent rows at `lat` (a sequence, or a part of one): out (M, R) = the latents summed
// with weights exp(score - max), and per row its max and the weights' sum in `stats` (exp_rows), which the parts
// of a sequence are merged and normalized by (latent_attention). No rows: zeros, max -inf.
template <typename T>
void attend_part(const float* q, const T* lat, int64_t ld, int64_t M, int64_t S, int64_t D, int64_t R, float scale,
                 float* scores, float* out, float* stats) {
  if (S == 0) {
    std::fill(out, out + M * R, 0.f);
    for (int64_t m = 0; m < M; ++m) stats[2 * m] = -INFINITY, stats[2 * m + 1] = 0.f;
    return;
  }
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) scores_block<8>(q + m * D, lat, ld, S, D, scale, scores + m * S, S);
  for (; m < M; ++m) scores_block<1>(q + m * D, lat, ld, S, D, scale, scores + m * S, S);
  exp_rows(scores, M, S, stats);
  for (m = 0; m + 8 <= M; m += 8) weighted_sum_block<8>(scores + m * S, S, lat, ld, S, R, out + m * R);
  for (; m < M; ++m) weighted_sum_block<1>(scores + m * S, S, lat, ld, S, R, out + m * R);
}

// Fewer sequences than threads (batch-1 decode above all): each sequence's latent rows are split into parts, at
// least MIN_PART_ROWS each, attended to by as many threads and merged (flash-decoding's split of the keys). One
// thread over 4,096 latents would leave the others idle through most of a long-context step.
constexpr int64_t MIN_PART_ROWS = 256;

// q (B, M, D), latents (B, S, D) with contiguous rows, lengths (B,) int64 or none (all S) → (B, M, R) in q's dtype
at::Tensor latent_attention(const at::Tensor& q, const at::Tensor& latents, const c10::optional<at::Tensor>& lengths,
                            double scale, int64_t value_dim) {
  TORCH_CHECK(q.dim() == 3 && latents.dim() == 3 && latents.size(0) == q.size(0) && latents.size(2) == q.size(2),
              "latent_attention: q (B, M, D) and latents (B, S, D)");
  TORCH_CHECK(latents.stride(2) == 1 && value_dim > 0 && value_dim <= q.size(2),
              "latent_attention: contiguous latent rows, 0 < value_dim <= D");
  TORCH_CHECK(latents.scalar_type() == at::kFloat || latents.scalar_type() == at::kBFloat16,
              "latent_attention: fp32 or bf16 latents");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "latent_attention: fp32 or bf16 q");
  const int64_t B = q.size(0), M = q.size(1), D = q.size(2), S = latents.size(1), R = value_dim;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = B >= threads ? 1 : std::max<int64_t>(1, std::min((threads + B - 1) / B, S / MIN_PART_ROWS));
  // q widened into this thread's buffer, each part's output and row statistics in others (kept: a decode step
  // makes a call a layer), then merged and stored in q's dtype: no conversions as separate ops
  thread_local std::vector<float> qf, of, st;
  seekforge_vectors::widen_rows_any(q, B, M, D, qf);
  of.resize(B * parts * M * R);
  st.resize(B * parts * M * 2);
  at::Tensor len;
  if (lengths.has_value()) len = lengths->to(at::kLong).contiguous();
  const int64_t* lp = len.defined() ? len.data_ptr<int64_t>() : nullptr;
  auto run = [&](auto* base) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(base)>>;
    const int64_t bs = latents.stride(0), rs = latents.stride(1);
    const float* qp = qf.data();
    float *op = of.data(), *sp = st.data();
    at::parallel_for(0, B * parts, 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> scores;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / parts, k = i % parts;
        const int64_t s = lp ? std::min<int64_t>(lp[b], S) : S;
        const int64_t chunk = (s + parts - 1) / parts, first = std::min(s, k * chunk);
        const int64_t rows = std::min(s, first + chunk) - first;
        scores.resize(M * rows);
        attend_part<T>(qp + b * M * D, base + b * bs + first * rs, rs, M, rows, D, R, (float)scale, scores.data(),
                       op + i * M * R, sp + i * M * 2);
      }
    });
  };
  if (latents.scalar_type() == at::kBFloat16) run(latents.data_ptr<c10::BFloat16>());
  else run(latents.data_ptr<float>());
  at::Tensor out = at::empty({B, M, R}, q.options());
  auto store = [&](auto* dst) {  // Σ_k e^(max_k - max) out_k / Σ_k e^(max_k - max) sum_k over a sequence's parts
    using T = std::remove_pointer_t<decltype(dst)>;
    std::vector<float> merged(R);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t m = 0; m < M; ++m) {
        float mx = -INFINITY, total = 0.f;
        for (int64_t k = 0; k < parts; ++k) mx = std::max(mx, st[((b * parts + k) * M + m) * 2]);
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t k = 0; k < parts; ++k) {
          const float* stats = &st[((b * parts + k) * M + m) * 2];
          if (stats[1] == 0.f) continue;  // a part without rows
          const float w = std::exp(stats[0] - mx);
          total += w * stats[1];
          const float* part = &of[((b * parts + k) * M + m) * R];
          for (int64_t r = 0; r < R; ++r) merged[r] += w * part[r];
        }
        T* row = dst + (b * M + m) * R;
        const float inv = total > 0.f ? 1.f / total : 0.f;  // no latents at all (length 0): zeros
        for (int64_t r = 0; r < R; ++r) row[r] = static_cast<T>(merged[r] * inv);
      }
  };
  if (q.scalar_type() == at::kBFloat16) store(out.data_ptr<c10::BFloat16>());
  else store(out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(seekforge, m) {
  m.def("latent_attention(Tensor q, Tensor latents, Tensor? lengths, float scale, int value_dim) -> Tensor");
}
TORCH_LIBRARY_IMPL(seekforge, CPU, m) { m.impl("latent_attention", &latent_attention); }

extern "C" AOTITorchError aoti_torch_cpu_latent_attention(AtenTensorHandle q, AtenTensorHandle latents,
                                                          AtenTensorHandle* lengths, double scale, int64_t value_dim,
                                                          AtenTensorHandle* ret0) {
  using seekforge_shims::tensor;
  return seekforge_shims::returning(ret0, [&] {
    return latent_attention(tensor(q), tensor(latents), seekforge_shims::optional_tensor(lengths), scale, value_dim);
  });
}
