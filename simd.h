// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// The pieces that attention.cpp and rowwise.cpp share, for AVX-512 (16 fp32 lanes) and AVX2 (8):
// which of the two runs (check_avx2, wide), lanes loaded from and stored to fp32 or bf16 memory,
// bf16 rounding, exp.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX2 __attribute__((target("avx2,fma")))
// On the loops over a register tile's rows and vectors (as in kernels.cpp): unrolled from the
// start, GCC keeps the tile's sums in registers instead of storing them on every step.
#define UNROLL _Pragma("GCC unroll 32")

bool attention_supported();  // attention.cpp: AVX-512 with BW and VL

// Every op's first check: its AVX2 code is the least it runs.
inline void check_avx2() {
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  TORCH_CHECK(avx2, "brisk's kernels need AVX2 and FMA (kernels.best_isa())");
}

// The AVX-512 code where the ops' isa argument asks for it (kernels.ISA_CODES: 1, 2) and the CPU
// has it, else AVX2's.
inline bool wide(int64_t isa) {
  static const bool avx512 = attention_supported();
  return isa != 0 && avx512;
}

// Asks for the cache lines of n elements at p + ahead elements, into L1, so that they come from
// memory while the elements before them are used.
template <class T>
inline void prefetch_lines(const T* p, int64_t ahead, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p + ahead);
  for (int64_t o = 0; o < n * int64_t(sizeof(T)); o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

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

// AVX2: 8 lanes; tails through a zero-padded buffer (AVX2 has no masked loads of 16-bit values).
AVX2 inline __m256 load8(const float* p, int64_t d) {
  if (d >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  std::copy(p, p + d, t);
  return _mm256_load_ps(t);
}
AVX2 inline __m256 load8(const at::BFloat16* p, int64_t d) {
  if (d >= 8)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  alignas(32) float t[8] = {};
  std::copy(p, p + d, t);
  return _mm256_load_ps(t);
}
// The first d of 8 values stored (bf16: rounded to nearest even, as c10::BFloat16).
AVX2 inline void store8(float* p, __m256 x, int64_t d) {
  if (d >= 8) return _mm256_storeu_ps(p, x);
  alignas(32) float t[8];
  _mm256_store_ps(t, x);
  std::copy(t, t + d, p);
}
AVX2 inline __m256 round_bf16_8(__m256 x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xffff0000u)));
}
AVX2 inline void store8(at::BFloat16* p, __m256 x, int64_t d) {
  __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(x)), 16);
  __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  if (d >= 8) return _mm_storeu_si128((__m128i*)p, h);
  alignas(16) uint16_t t[8];
  _mm_store_si128((__m128i*)t, h);
  std::memcpy(p, t, std::min<int64_t>(d, 8) * sizeof(uint16_t));
}
AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// exp(x) for x <= 0, as simd.h's exp16: the same polynomial, 2^n put into the exponent's bits.
AVX2 inline __m256 exp8(__m256 x) {
  __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(masked, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
