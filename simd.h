// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// AVX-512 pieces that attention.cpp and rowwise.cpp share: 16 fp32 lanes loaded from and stored to
// fp32 or bf16 memory, bf16 rounding, exp. Callers check the CPU first (attention_supported).
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// 16 values of a vector as fp32, of which the first d are read (d <= 0: none; zeros past d).
AVX512 inline __mmask16 first(int64_t d) {
  return d >= 16 ? (__mmask16)0xffff : d <= 0 ? (__mmask16)0 : (__mmask16)((1u << d) - 1);
}
AVX512 inline __m512 load16(const float* p, int64_t d) {
  return d >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first(d), p);
}
AVX512 inline __m512 load16(const at::BFloat16* p, int64_t d) {
  __m256i h = d >= 16 ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16(first(d), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x rounded to the nearest bf16 (ties to even, as c10::BFloat16), kept as fp32. (NaN is not kept.)
AVX512 inline __m512 round_bf16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}
// The first d of 16 values stored (bf16: rounded).
AVX512 inline void store16(float* p, __m512 x, int64_t d) { _mm512_mask_storeu_ps(p, first(d), x); }
AVX512 inline void store16(at::BFloat16* p, __m512 x, int64_t d) {
  __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(x)), 16));
  _mm256_mask_storeu_epi16(p, first(d), h);
}

// exp(x) for x <= 0 (scores minus their maximum); -inf (a masked position) gives 0. A degree-6
// polynomial on [-ln2 / 2, ln2 / 2] and scaling by 2^n: within 2 ulp of expf.
AVX512 inline __m512 exp16(__m512 x) {
  __mmask16 masked = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(~masked, _mm512_scalef_ps(p, n));
}
