// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// A product for a few rows that streams each weight once: y[M, N] = x[M, K] @ W[N, K]^T, fp32.
//
// W is packed once as [N / 32, K, 32] (N padded with zero rows): the 32 output columns of a block
// are one contiguous stream, read once from memory for all M rows (up to 8 at a time from
// registers, further rows from the cache). Each step of k broadcasts x[m, k] into a vector and
// adds it times W[k, 32 columns] into the row's accumulators: no horizontal sums, no repacking of x.
// Blocks are split between torch's threads. Built at first use by kernels.py; the instruction set
// is picked at run time (functions compiled per target, chosen by what the CPU reports).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

constexpr int64_t BLOCK = 32;

// AVX-512: a block is two vectors; 8 rows x 2 vectors = 16 accumulators of the 32 registers.
template <int ROWS>
__attribute__((target("avx512f"))) static void tile_avx512(const float* x, int64_t K, const float* w, float* y,
                                                           int64_t ldy, int64_t columns) {
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m512 w0 = _mm512_loadu_ps(w + k * BLOCK), w1 = _mm512_loadu_ps(w + k * BLOCK + 16);
    for (int m = 0; m < ROWS; m++) {
      __m512 xk = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xk, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xk, w1, acc[m][1]);
    }
  }
  __mmask16 lo = columns >= 16 ? 0xffff : (1u << columns) - 1;
  __mmask16 hi = columns >= 32 ? 0xffff : columns <= 16 ? 0 : (1u << (columns - 16)) - 1;
  for (int m = 0; m < ROWS; m++) {
    _mm512_mask_storeu_ps(y + m * ldy, lo, acc[m][0]);
    _mm512_mask_storeu_ps(y + m * ldy + 16, hi, acc[m][1]);
  }
}

// AVX2: 16 registers, so half a block (two vectors) at a time for up to 6 rows: 12 accumulators.
template <int ROWS>
__attribute__((target("avx2,fma"))) static void tile_avx2(const float* x, int64_t K, const float* w, float* y,
                                                          int64_t ldy, int64_t columns) {
  for (int64_t half = 0; half < BLOCK; half += 16) {
    if (half >= columns) break;
    __m256 acc[ROWS][2];
    for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
      __m256 w0 = _mm256_loadu_ps(w + k * BLOCK + half), w1 = _mm256_loadu_ps(w + k * BLOCK + half + 8);
      for (int m = 0; m < ROWS; m++) {
        __m256 xk = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(xk, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xk, w1, acc[m][1]);
      }
    }
    alignas(32) float out[16];
    int64_t n = std::min<int64_t>(16, columns - half);
    for (int m = 0; m < ROWS; m++) {
      _mm256_store_ps(out, acc[m][0]);
      _mm256_store_ps(out + 8, acc[m][1]);
      std::copy(out, out + n, y + m * ldy + half);
    }
  }
}

using Tile = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
static const Tile AVX512[] = {tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>,
                              tile_avx512<5>, tile_avx512<6>, tile_avx512<7>, tile_avx512<8>};
static const Tile AVX2[] = {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};

// "avx512", "avx2" or "" (neither: kernels.py does not pack then).
std::string best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "";
}

torch::Tensor pack(const torch::Tensor& w) {  // [N, K] -> [ceil(N / 32), K, 32]
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat, "pack: a 2-D float32 weight");
  int64_t N = w.size(0), K = w.size(1), blocks = (N + BLOCK - 1) / BLOCK;
  auto padded = torch::zeros({blocks * BLOCK, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, BLOCK, K}).transpose(1, 2).contiguous();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, c10::string_view isa) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat, "linear: float32 only");
  int64_t K = x.size(-1), blocks = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == BLOCK && blocks * BLOCK >= N,
              "linear: packed weight of another shape");
  auto x2 = x.reshape({-1, K}).contiguous();
  int64_t M = x2.size(0);
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  const float *xp = x2.data_ptr<float>(), *wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  bool wide = isa == "avx512";
  TORCH_CHECK(wide || isa == "avx2", "linear: unknown instruction set ", isa);
  const Tile* tiles = wide ? AVX512 : AVX2;
  int64_t rows_per_tile = wide ? 8 : 6;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      int64_t columns = std::min(BLOCK, N - b * BLOCK);
      for (int64_t m = 0; m < M; m += rows_per_tile) {
        int64_t rows = std::min(rows_per_tile, M - m);
        tiles[rows - 1](xp + m * K, K, wp + b * K * BLOCK, yp + m * N + b * BLOCK, N, columns);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("best_isa", &best_isa);
  m.def("pack", &pack);
}

// An operator of torch's own registry, so that a compiled graph calls the kernel without passing
// through Python (kernels.py adds the shape function torch.compile traces with).
TORCH_LIBRARY(brisk, m) { m.def("packed_linear(Tensor x, Tensor packed, int out_features, str isa) -> Tensor"); }
TORCH_LIBRARY_IMPL(brisk, CPU, m) { m.impl("packed_linear", &linear); }
