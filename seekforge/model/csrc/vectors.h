// AVX-512 helpers the CPU kernels share (seekforge/model/kernels.py builds them): 16 values of a row at a time.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cstdint>
#include <vector>

namespace seekforge_vectors {

// the values of a row selected by k (16 at most) → fp32, zeros elsewhere
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 k) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// the columns d … d+15 of a row n wide that exist
inline __mmask16 columns(int64_t d, int64_t n) {
  return n - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - d)) - 1);
}

// x (G, M, K) of fp32 or bf16 values, any strides (a transposed or broadcast view: a decode step's heads, a token
// repeated for each of its experts), or any contiguous shape read as (G, M, K) → fp32 in `out`, row-major. The
// kernels' query rows: widening them here saves the copy x.contiguous() makes of a view first (~5 µs a call at
// decode sizes, a dozen calls a step).
template <typename T>
void widen_rows(const at::Tensor& x, int64_t G, int64_t M, int64_t K, float* out) {
  const T* p = x.data_ptr<T>();
  if (x.is_contiguous()) {
    for (int64_t i = 0; i < G * M * K; ++i) out[i] = static_cast<float>(p[i]);
    return;
  }
  const int64_t sg = x.stride(0), sm = x.stride(1), sk = x.stride(2);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < M; ++m, out += K) {
      const T* row = p + g * sg + m * sm;
      for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>(row[k * sk]);
    }
}

// widen_rows for an fp32 or bf16 x into a buffer sized to fit; x must be contiguous or three-dimensional
inline void widen_rows_any(const at::Tensor& x, int64_t G, int64_t M, int64_t K, std::vector<float>& out) {
  TORCH_CHECK(x.is_contiguous() || x.dim() == 3, "the query rows must be contiguous or (G, M, K)");
  out.resize(G * M * K);
  if (x.scalar_type() == at::kFloat) {
    widen_rows<float>(x, G, M, K, out.data());
  } else {
    widen_rows<c10::BFloat16>(x, G, M, K, out.data());
  }
}

}  // namespace seekforge_vectors
