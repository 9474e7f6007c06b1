// AVX-512 helpers the CPU kernels share (seekforge/model/kernels.py builds them): 16 values of a row at a time.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cstdint>

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

}  // namespace seekforge_vectors
