// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// The row-wise work between a layer's products, one op each: RMSNorm, RoPE on q or k, SwiGLU's
// silu(gate) * up. In PyTorch they are 2-12 dispatched ops apiece, ~40 a layer, and an eager step
// of a small quantized model spent longer dispatching them than in its products. kernels.py
// attaches them to eager steps only: a compiled graph keeps model.py's code, which inductor fuses.
// Rounded where model.py rounds (each fp32 result to the activations' dtype where model.py
// converts), so bf16 results equal PyTorch's but where a sum in another order rounds the other way.
// AVX-512 (simd.h) or AVX2, by the ops' isa argument (kernels.ISA_CODES, as the products'); RoPE
// plain C++ the compiler vectorises. Built with kernels.cpp into one extension (kernels.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace {

// Rows per thread below which the threads' start-up costs more than the work.
constexpr int64_t GRAIN = 16;

template <typename T>
AVX512 void rms_norm_row(const T* x, const T* w, T* y, int64_t D, float eps, float offset) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 v = load16(x + d, D - d);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / float(D) + eps));
  for (int64_t d = 0; d < D; d += 16) {
    __m512 normed = _mm512_mul_ps(load16(x + d, D - d), inv);
    if (offset != 0.f)  // Gemma: scaled by (offset + weight) in fp32, rounded once
      normed = _mm512_mul_ps(normed, _mm512_add_ps(_mm512_set1_ps(offset), load16(w + d, D - d)));
    else  // normalised in fp32, rounded to T, then scaled in T (one more rounding)
      normed = _mm512_mul_ps(std::is_same_v<T, float> ? normed : round_bf16(normed), load16(w + d, D - d));
    store16(y + d, normed, D - d);
  }
}

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (<= 1, never overflows): 1 / (1 + e) for
// g >= 0, e / (1 + e) below.
template <typename T>
AVX512 void silu_mul_row(const T* g, const T* u, T* y, int64_t H) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < H; i += 16) {
    __m512 gv = load16(g + i, H - i);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
    __mmask16 negative = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    __m512 silu = _mm512_mul_ps(gv, sigmoid);
    if constexpr (!std::is_same_v<T, float>) silu = round_bf16(silu);  // model.py: act(gate) in T, then * up
    store16(y + i, _mm512_mul_ps(silu, load16(u + i, H - i)), H - i);
  }
}

// AVX2: the same, 8 lanes at a time.
template <typename T>
AVX2 void rms_norm_row8(const T* x, const T* w, T* y, int64_t D, float eps, float offset) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 v = load8(x + d, D - d);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  __m256 inv = _mm256_set1_ps(1.f / std::sqrt(sum8(squares) / float(D) + eps));
  for (int64_t d = 0; d < D; d += 8) {
    __m256 normed = _mm256_mul_ps(load8(x + d, D - d), inv);
    if (offset != 0.f)
      normed = _mm256_mul_ps(normed, _mm256_add_ps(_mm256_set1_ps(offset), load8(w + d, D - d)));
    else
      normed = _mm256_mul_ps(std::is_same_v<T, float> ? normed : round_bf16_8(normed), load8(w + d, D - d));
    store8(y + d, normed, D - d);
  }
}

template <typename T>
AVX2 void silu_mul_row8(const T* g, const T* u, T* y, int64_t H) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) {
    __m256 gv = load8(g + i, H - i);
    __m256 e = exp8(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.f), gv)));
    __m256 negative = _mm256_cmp_ps(gv, zero, _CMP_LT_OQ);
    __m256 silu = _mm256_mul_ps(gv, _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e)));
    if constexpr (!std::is_same_v<T, float>) silu = round_bf16_8(silu);
    store8(y + i, _mm256_mul_ps(silu, load8(u + i, H - i)), H - i);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps, float offset, bool avx512) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      if (avx512)
        rms_norm_row(x + r * D, w, y + r * D, D, eps, offset);
      else
        rms_norm_row8(x + r * D, w, y + r * D, D, eps, offset);
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t H, bool avx512) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      if (avx512)
        silu_mul_row(gu + r * 2 * H, gu + r * 2 * H + H, y + r * H, H);
      else
        silu_mul_row8(gu + r * 2 * H, gu + r * 2 * H + H, y + r * H, H);
  });
}

// x [B, T, H, hd] (any strides but the last), rope [T or B * T, rd, 2] (cos, sin) fp32 -> y
// contiguous: feature i rotated with i + rd / 2 (HF's rotate_half), features past rd copied.
template <typename T>
void rope_rows(const at::Tensor& x, const float* rope, int64_t rope_b_stride, int64_t rd, T* y) {
  int64_t B = x.size(0), Tn = x.size(1), H = x.size(2), hd = x.size(3), half = rd / 2;
  const T* xd = x.data_ptr<T>();
  int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  at::parallel_for(0, B * Tn, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; bt++) {
      int64_t b = bt / Tn, t = bt % Tn;
      const float* cs = rope + b * rope_b_stride + t * rd * 2;
      for (int64_t h = 0; h < H; h++) {
        const T* xr = xd + b * sb + t * st + h * sh;
        T* yr = y + (bt * H + h) * hd;
        for (int64_t i = 0; i < half; i++)
          yr[i] = T(float(xr[i]) * cs[2 * i] + -float(xr[i + half]) * cs[2 * i + 1]);
        for (int64_t i = half; i < rd; i++)
          yr[i] = T(float(xr[i]) * cs[2 * i] + float(xr[i - half]) * cs[2 * i + 1]);
        for (int64_t i = rd; i < hd; i++) yr[i] = xr[i];
      }
    }
  });
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, double offset, int64_t isa) {
  check_avx2();
  TORCH_CHECK(float_or_bf16(x) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x and weight both float32 or both bfloat16");
  int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "rms_norm: weight of x's last dimension");
  x = x.contiguous();
  weight = weight.contiguous();
  auto y = at::empty_like(x);
  int64_t rows = D ? x.numel() / D : 0;
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, D, eps, offset, wide(isa));
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows,
                  D, eps, offset, wide(isa));
  return y;
}

at::Tensor silu_mul(at::Tensor gate_up, int64_t hidden, int64_t isa) {
  check_avx2();
  TORCH_CHECK(float_or_bf16(gate_up) && gate_up.size(-1) == 2 * hidden,
              "silu_mul: gate_up float32 or bfloat16, its last dimension 2 * hidden");
  gate_up = gate_up.contiguous();
  auto shape = gate_up.sizes().vec();
  shape.back() = hidden;
  auto y = at::empty(shape, gate_up.options());
  int64_t rows = hidden ? gate_up.numel() / (2 * hidden) : 0;
  if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), y.data_ptr<float>(), rows, hidden, wide(isa));
  else
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, hidden, wide(isa));
  return y;
}

at::Tensor apply_rope(at::Tensor x, at::Tensor rope) {
  check_avx2();
  TORCH_CHECK(float_or_bf16(x) && x.dim() == 4, "apply_rope: x [B, T, heads, head_dim] float32 or bfloat16");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.size(-1) == 2 && rope.size(-2) <= x.size(3) &&
                  rope.size(-2) % 2 == 0 &&
                  (rope.dim() == 3 || rope.dim() == 4 && (rope.size(0) == x.size(0) || rope.size(0) == 1)) &&
                  rope.size(-3) == x.size(1),
              "apply_rope: rope [T, rd, 2] or [B or 1, T, rd, 2] float32, rd even and at most head_dim");
  if (x.stride(3) != 1) x = x.contiguous();
  rope = rope.contiguous();
  int64_t rd = rope.size(-2);
  int64_t rope_b_stride = rope.dim() == 4 && rope.size(0) > 1 ? x.size(1) * rd * 2 : 0;  // else one for every row
  auto y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows<float>(x, rope.data_ptr<float>(), rope_b_stride, rd, y.data_ptr<float>());
  else
    rope_rows<at::BFloat16>(x, rope.data_ptr<float>(), rope_b_stride, rd, y.data_ptr<at::BFloat16>());
  return y;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset, int isa) -> Tensor");
  m.def("silu_mul(Tensor gate_up, int hidden, int isa) -> Tensor");
  m.def("apply_rope(Tensor x, Tensor rope) -> Tensor");
}
TORCH_LIBRARY_IMPL(brisk, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("apply_rope", &apply_rope);
}
