// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// Products for a few rows that stream each weight once: y[M, N] = x[M, K] @ W[N, K]^T, x and y fp32,
// W fp32, int8 (one scale per output column) or int4 (a scale and a zero per group of input columns);
// or x, W and y bf16 (fp32 sums; dot products where the CPU has AVX-512 BF16, a prompt's rows on AMX
// tiles where it has them).
//
// W is packed once (kernels.py) as [N / 32, K, 32] (N padded with zero rows): the 32 output columns
// of a block are one contiguous stream, read once from memory for all M rows (up to 8 at a time from
// registers; more rows go over it a 4 KB chunk at a time, every tile of rows from L1). Each step
// of k turns W[k, 32 columns] into fp32 vectors, broadcasts x[m, k] and adds their product into the
// row's accumulators: no horizontal sums, no repacking of x. Quantized weights are scaled per block
// of the sum, not per weight: int8 once at the end, int4 once per group, where
// sum_k x (q - 8) s + x z = s * sum_k x q + (z - 8 s) * sum_k x.
// With AVX-512 VNNI, or AVX2 alone, int8 / int4 multiply bytes in integers instead (below).
// Blocks are split between torch's threads. Built at first use by kernels.py; the instruction set
// is picked at run time (functions compiled per target, chosen by what the CPU reports).
// ATen's tensor and torch's op registry alone: torch/extension.h (pybind11, the C++ frontend) would
// be most of each file's compile, a first run's wait (README, How it works).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/constant_pad_nd.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <type_traits>

constexpr int64_t BLOCK = 32;
constexpr int64_t PANEL = 32;         // rows of x a call of a tile function gets at most
constexpr int64_t CHUNK_BYTES = 4096;  // of a block, that a panel's tiles go over in turn (over_chunks)
constexpr int64_t PROMPT_K = 32;  // k a chunk of a prompt's AVX2 fp32 tiles (prompt_avx2)
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))
// On the loops over a tile's rows and vectors: unrolled completely from the start, GCC keeps the
// tile's sums in registers; left to its own heuristics (GCC 12, -O3), it unrolled them later and
// stored every sum to the stack on every step of k, which bounded an AVX2 tile by its stores.
#define UNROLL _Pragma("GCC unroll 32")

AVX512 static inline __m512 bf16x16(const uint16_t* p) {  // 16 bf16 -> fp32 (bf16 is fp32's top half)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
AVX2 static inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// Each weight is read from memory once a step. Asking for the lines ahead of their use keeps more
// of them in flight than the hardware prefetchers do on their own: 2 KB ahead for one row of x
// (further was slower); a tile of more rows spends longer on each line, and kept more of them in
// flight 8 KB ahead, which also covers a chunk of a panel (over_chunks) (README, How it works).
template <int ROWS> constexpr int64_t AHEAD = ROWS == 1 ? 2048 : 8192;
static inline void prefetch_ahead(const void* p, int64_t bytes = AHEAD<1>) {
  _mm_prefetch((const char*)p + bytes, _MM_HINT_T1);
}
// AVX2's one-row fp32 product (the decode of an fp32 model on a CPU without AVX-512) read more
// with the lines brought into L1 than into L2 (the integer and bf16 tiles did not).
static inline void prefetch_ahead_l1(const void* p) { _mm_prefetch((const char*)p + 2048, _MM_HINT_T0); }

// Each format gives the fp32 weights of block row k (AVX-512: all 32 columns; AVX2, fp32 alone:
// the 16 from `half`, or all), how many k share a scale (`group`), and how a group's sums go into
// the output.
struct F32 {
  const float* w;
  int64_t group;  // K: one group
  AVX512 void get(int64_t k, __m512& a, __m512& b, int64_t ahead) const {
    prefetch_ahead(w + k * BLOCK, ahead), prefetch_ahead(w + k * BLOCK + 16, ahead);
    a = _mm512_loadu_ps(w + k * BLOCK), b = _mm512_loadu_ps(w + k * BLOCK + 16);
  }
  // A prompt's AVX2 tiles (prompt_avx2) go over a block 32 k (4 KB) at a time, every 6 rows in
  // turn: the first tile asks for the next 4 KB into L1, which then has the whole chunk's work to
  // arrive in; 2 KB ahead into L2, half a chunk, left the second half waiting on memory (README).
  AVX2 void get(int64_t k, int64_t half, __m256& a, __m256& b) const {
    _mm_prefetch((const char*)(w + (k + PROMPT_K) * BLOCK), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (k + PROMPT_K) * BLOCK + 16), _MM_HINT_T0);
    a = _mm256_loadu_ps(w + k * BLOCK + half), b = _mm256_loadu_ps(w + k * BLOCK + half + 8);
  }
  AVX2 void get(int64_t k, __m256 (&v)[4]) const {  // the whole block row (one or two rows of x)
    prefetch_ahead_l1(w + k * BLOCK), prefetch_ahead_l1(w + k * BLOCK + 16);
    UNROLL for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(w + k * BLOCK + 8 * i);
  }
  AVX512 __m512 scale512(int64_t g, int64_t c) const { return _mm512_set1_ps(1.f); }
  AVX2 __m256 scale256(int64_t g, int64_t c) const { return _mm256_set1_ps(1.f); }
  int64_t chunk() const { return CHUNK_BYTES / (BLOCK * 4); }  // k a chunk (over_chunks)
};

struct Int8 {
  const int8_t* w;
  const float* scales;  // the block's 32
  int64_t group;
  AVX512 void get(int64_t k, __m512& a, __m512& b, int64_t ahead) const {
    prefetch_ahead(w + k * BLOCK, ahead);
    __m256i q = _mm256_loadu_si256((const __m256i*)(w + k * BLOCK));
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  }
  AVX512 __m512 scale512(int64_t g, int64_t c) const { return _mm512_loadu_ps(scales + c); }
  AVX2 __m256 scale256(int64_t g, int64_t c) const { return _mm256_loadu_ps(scales + c); }
  int64_t chunk() const { return CHUNK_BYTES / BLOCK; }
};

// bf16 values per group and block of 32 outputs in an int4 layer's sz: 32 scales, then 32 zeros
// unless every zero is 0.
static int64_t sz_per_group(bool zeros) { return zeros ? 2 * BLOCK : BLOCK; }

// int4: 16 bytes per block row, byte j holding column j (low nibble) and column j + 16 (high).
struct Int4 {
  const uint8_t* w;
  const uint16_t* sz;  // bf16 [groups, 2, 32]: the block's scales, then its zeros, per group; or
                       // [groups, 32], scales alone, where every zero is 0 (symmetric: 4.5 bits a weight)
  const float* xsum;   // sum of x over each group, [rows, groups]
  int64_t group, groups;
  bool zeros;          // sz holds zeros
  AVX512 void get(int64_t k, __m512& a, __m512& b, int64_t ahead) const {
    prefetch_ahead(w + k * BLOCK / 2, ahead);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w + k * BLOCK / 2)));
    a = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
    b = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  }
  int64_t stride() const { return sz_per_group(zeros); }
  AVX512 __m512 scale512(int64_t g, int64_t c) const { return bf16x16(sz + g * stride() + c); }
  AVX2 __m256 scale256(int64_t g, int64_t c) const { return bf16x8(sz + g * stride() + c); }
  AVX512 __m512 offset512(int64_t g, int64_t c) const {  // z - 8 s
    __m512 z = zeros ? bf16x16(sz + g * stride() + BLOCK + c) : _mm512_setzero_ps();
    return _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale512(g, c), z);
  }
  AVX2 __m256 offset256(int64_t g, int64_t c) const {
    __m256 z = zeros ? bf16x8(sz + g * stride() + BLOCK + c) : _mm256_setzero_ps();
    return _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale256(g, c), z);
  }
  int64_t chunk() const { return (CHUNK_BYTES / (BLOCK / 2) + group - 1) / group * group; }  // whole groups
};

// out[m, c] += scale[c] * acc[m, c] (+ offset[c] * sum of row m's x over the group, int4)
template <int ROWS, class W>
AVX512 static inline void add_group(const W& w, int64_t g, __m512 (&acc)[ROWS][2], float (*out)[BLOCK]) {
  UNROLL for (int j = 0; j < 2; j++) {
    __m512 s = w.scale512(g, 16 * j), offset = _mm512_setzero_ps();
    if constexpr (std::is_same_v<W, Int4>) offset = w.offset512(g, 16 * j);
    UNROLL for (int m = 0; m < ROWS; m++) {
      __m512 o = _mm512_fmadd_ps(acc[m][j], s, _mm512_loadu_ps(out[m] + 16 * j));
      if constexpr (std::is_same_v<W, Int4>) o = _mm512_fmadd_ps(offset, _mm512_set1_ps(w.xsum[m * w.groups + g]), o);
      _mm512_storeu_ps(out[m] + 16 * j, o);
    }
  }
}

// AVX2 (fp32, and int8's integer sums; int4 is integer there and adds its own offsets): V vectors
// of 8 columns from column c0.
template <int ROWS, int V, class W>
AVX2 static inline void add_group(const W& w, int64_t g, int64_t c0, __m256 (&acc)[ROWS][V],
                                  float (*out)[BLOCK]) {
  UNROLL for (int j = 0; j < V; j++) {
    int64_t c = c0 + 8 * j;
    __m256 s = w.scale256(g, c);
    UNROLL for (int m = 0; m < ROWS; m++)
      _mm256_storeu_ps(out[m] + c, _mm256_fmadd_ps(acc[m][j], s, _mm256_loadu_ps(out[m] + c)));
  }
}

// AVX-512: a block is two vectors; 8 rows x 2 vectors = 16 accumulators of the 32 registers. Adds
// the products over k in [k0, k1) (whole groups) into out.
template <int ROWS, class W>
AVX512 static void tile_avx512(const float* x, int64_t K, int64_t k0, int64_t k1, const W& w, float (*out)[BLOCK]) {
  for (int64_t g0 = k0; g0 < k1; g0 += w.group) {
    __m512 acc[ROWS][2];
    UNROLL for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = g0, g1 = std::min(k1, g0 + w.group); k < g1; k++) {
      __m512 w0, w1;
      w.get(k, w0, w1, AHEAD<ROWS>);
      UNROLL for (int m = 0; m < ROWS; m++) {
        __m512 xk = _mm512_set1_ps(x[m * K + k]);
        acc[m][0] = _mm512_fmadd_ps(xk, w0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(xk, w1, acc[m][1]);
      }
    }
    add_group<ROWS>(w, g0 / w.group, acc, out);
  }
}

template <int R, int MAX, class F>
static void with_rows(int64_t rows, F&& f) {  // f(std::integral_constant<int, rows>)
  if constexpr (R < MAX) {
    if (rows != R) return with_rows<R + 1, MAX>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// More rows than a tile holds, up to a panel (a short prompt, a batch of streams), go over a block
// in chunks of `chunk` of its `steps` (the tile's steps over k), every tile of up to TILE rows in
// turn over a chunk: the first from memory, the others from L1, while the next chunk arrives
// (prefetch_ahead). A tile at a time over the whole block read it from L2 again for every tile, with
// no weights in flight. A longer prompt (M, more than a panel) is bound by the tiles' arithmetic,
// not by memory, and each tile goes over the whole block with its sums in registers: chunks were
// slower there. f(std::integral_constant<int, rows>, first row, k0, k1).
template <int TILE, class F>
static void over_chunks(int64_t M, int64_t rows, int64_t steps, int64_t chunk, F&& f) {
  if (rows <= TILE || M > PANEL) chunk = steps;
  for (int64_t k0 = 0; k0 < steps; k0 += chunk)
    for (int64_t m = 0; m < rows; m += TILE)
      with_rows<1, TILE>(std::min<int64_t>(TILE, rows - m), [&](auto R) { f(R, m, k0, std::min(steps, k0 + chunk)); });
}

// AVX2 fp32: 16 registers, so half a block (two vectors) at a time for up to 6 rows: 12
// accumulators, over k in [k0, k1).
template <int ROWS>
AVX2 static void tile_avx2(const float* x, int64_t K, int64_t k0, int64_t k1, int64_t half, const F32& w,
                           float (*out)[BLOCK]) {
  __m256 acc[ROWS][2];
  UNROLL for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k++) {
    __m256 w0, w1;
    w.get(k, half, w0, w1);
    UNROLL for (int m = 0; m < ROWS; m++) {
      __m256 xk = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xk, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xk, w1, acc[m][1]);
    }
  }
  add_group<ROWS, 2>(w, 0, half, acc, out);
}

// AVX2, 3 rows or more (a prompt): up to PROMPT_ROWS rows a call in tiles of 6, and k in chunks of
// PROMPT_K (4 KB of the block, a page) that every tile reads from L1 in turn, so that the block
// comes from memory once for all the rows; a tile at a time over the whole of k read it again from
// L2 for every 6 rows (from L3 where a block outgrew L2). Chunks of 32 k ran faster than 16, 24,
// 48 or 64 at 16 rows (README, How it works).
constexpr int64_t PROMPT_ROWS = 30;

AVX2 static void prompt_avx2(const float* x, int64_t K, int64_t rows, const F32& w, float (*out)[BLOCK]) {
  for (int64_t k0 = 0; k0 < K; k0 += PROMPT_K) {
    int64_t k1 = std::min(K, k0 + PROMPT_K);
    for (int64_t m = 0; m < rows; m += 6)
      for (int64_t half = 0; half < BLOCK; half += 16)
        with_rows<1, 6>(std::min<int64_t>(6, rows - m), [&](auto R) {
          tile_avx2<decltype(R)::value>(x + m * K, K, k0, k1, half, w, out + m);
        });
  }
}

template <int ROWS>  // acc[m] += x[m, k] * the block's row k
AVX2 static inline void add_row(const float* x, int64_t K, const F32& w, int64_t k, __m256 (&acc)[ROWS][4]) {
  __m256 v[4];
  w.get(k, v);
  UNROLL for (int m = 0; m < ROWS; m++) {
    __m256 xk = _mm256_broadcast_ss(x + m * K + k);
    UNROLL for (int i = 0; i < 4; i++) acc[m][i] = _mm256_fmadd_ps(xk, v[i], acc[m][i]);
  }
}

// AVX2 fp32 for one or two rows (a decode step): the whole block a k. One row reads the block as
// two streams, k from the start and from the middle, into two sets of sums: 8 sums in flight (the
// half block's 2 a row waited on each FMA's latency), and twice the lines in flight from memory as
// one stream's prefetches keep.
template <int ROWS>
AVX2 static void tile_avx2_decode(const float* x, int64_t K, const F32& w, float (*out)[BLOCK]) {
  static_assert(ROWS <= 2, "8 sums, 4 weight vectors and x: 13 of the 16 registers");
  constexpr int U = ROWS == 1 ? 2 : 1;
  __m256 acc[U][ROWS][4];
  UNROLL for (int u = 0; u < U; u++)
    UNROLL for (int m = 0; m < ROWS; m++)
      UNROLL for (int i = 0; i < 4; i++) acc[u][m][i] = _mm256_setzero_ps();
  int64_t n = K / U;
  for (int64_t k = 0; k < n; k++)
    UNROLL for (int u = 0; u < U; u++) add_row<ROWS>(x, K, w, k + u * n, acc[u]);
  for (int64_t k = U * n; k < K; k++) add_row<ROWS>(x, K, w, k, acc[0]);
  UNROLL for (int u = 1; u < U; u++)
    UNROLL for (int m = 0; m < ROWS; m++)
      UNROLL for (int i = 0; i < 4; i++) acc[0][m][i] = _mm256_add_ps(acc[0][m][i], acc[u][m][i]);
  add_group<ROWS, 4>(w, 0, 0, acc[0], out);
}

// int8 / int4 with integer dot products: each row of x is rounded to int8 per 32 input columns (a
// scale d each, as llama.cpp's Q8_0), and the weights' bytes are multiplied by x's bytes, 4
// consecutive k summed per 32-bit lane, with no conversion of the weights. The weights are packed
// [N / 32, K / 4, 32, 4]: the 4 consecutive k of a column in one 32-bit lane. int8 weights are
// stored + 128 (unsigned); int4 codes are unsigned already.
struct QuantizedRows {  // x [M, K] -> q int8 [M, Kp] (Kp: K padded to 32), per 32 columns: d and sum q
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
};

AVX2 static inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AVX2 static inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

AVX2 static QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t Kp) {
  int64_t nb = Kp / BLOCK;
  QuantizedRows r{std::vector<int8_t>(M * Kp), std::vector<float>(M * nb), std::vector<int32_t>(M * nb)};
  alignas(32) float tail[BLOCK];
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < nb; b++) {
      int64_t k0 = b * BLOCK, n = std::max<int64_t>(0, std::min(BLOCK, K - k0));
      const float* p = x + m * K + k0;
      if (n < BLOCK) {  // K's last, partial block: zeros past K
        std::fill(tail, tail + BLOCK, 0.f);
        std::copy(p, p + n, tail);
        p = tail;
      }
      __m256 v[4], amax = _mm256_setzero_ps();
      UNROLL for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
      }
      float a = max8(amax), d = a / 127.f, inv = a > 0 ? 127.f / a : 0.f;
      __m256i q[4], sum = _mm256_setzero_si256();
      UNROLL for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));  // round to nearest even
        sum = _mm256_add_epi32(sum, q[i]);
      }
      // Narrowing packs within 128-bit halves: 32-bit units come out as q0 q1 q2 q3 (columns 0-3
      // of each) then their columns 4-7; the permutation puts each q's 8 bytes together again.
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(r.q.data() + m * Kp + k0), bytes);
      r.d[m * nb + b] = d;
      r.sum[m * nb + b] = sum8(sum);
    }
  }
  return r;
}

// AVX-512 VNNI: vpdpbusd adds 4 products of unsigned weight bytes and signed x bytes per lane: 4x the
// work of an fp32 FMA per instruction. int8's w + 128 gives sum (w + 128) q = sum w q + 128 sum q,
// and sum q is known per row and block.
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// acc += 4 products a lane of w's unsigned and x's signed bytes (vpdpbusd), in acc's own register.
// From the intrinsic (_mm512_dpbusd_epi32), GCC 12 gave the sums of a loop over k-quads a second
// set of registers and copied them across and back every k-quad: 16 moves beside 8 vpdpbusd.
VNNI static inline void dpbusd(__m512i& acc, __m512i w, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
}

// ia += the products of k-quad kq (4 k) of a block's 32 columns and ROWS rows of x
template <int ROWS, bool INT4>
VNNI static inline void k_quad(const uint8_t* w, const int32_t* xq, int64_t Kp, int64_t kq, __m512i (&ia)[ROWS][2]) {
  __m512i w0, w1;
  prefetch_ahead(w + kq * (INT4 ? 64 : 128), AHEAD<ROWS>);
  if constexpr (!INT4) prefetch_ahead(w + kq * 128 + 64, AHEAD<ROWS>);
  if constexpr (INT4) {
    __m512i v = _mm512_loadu_si512(w + kq * 64), low = _mm512_set1_epi8(15);
    w0 = _mm512_and_si512(v, low), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  } else {
    w0 = _mm512_loadu_si512(w + kq * 128), w1 = _mm512_loadu_si512(w + kq * 128 + 64);
  }
  UNROLL for (int m = 0; m < ROWS; m++) {
    __m512i xb = _mm512_set1_epi32(xq[m * Kp / 4 + kq]);
    dpbusd(ia[m][0], w0, xb);
    dpbusd(ia[m][1], w1, xb);
  }
}

// Up to 4 rows: 8 integer and 8 float accumulators. INT4: 64 bytes per k-quad (columns j and
// j + 16 in a byte's nibbles), a scale and zero per `group` (zeros: false for scales alone); int8:
// 128 bytes, one scale at the end. UNROLLED: a block's 8 k-quads unrolled, for a prompt's tiles
// (more rows than a panel), bound by their arithmetic: with the intrinsic's copies (dpbusd) they
// ran at under half vpdpbusd's rate as a loop, and unrolling was what first removed them. A
// panel's tiles (a decode step, a batch of streams) keep the loop: unrolled, a tile reading its
// block from memory was slower (its loads and prefetches bunched together), and the engine's int8
// decode of 8 streams lost 12% while 16 gained 5-13%.
template <int ROWS, bool INT4, bool UNROLLED>
VNNI static void tile_vnni(const QuantizedRows& x, int64_t m0, int64_t Kp, int64_t b0, int64_t b1, const uint8_t* w,
                           const float* scales, const uint16_t* sz, bool zeros, const float* xsum, int64_t group,
                           float (*out)[BLOCK]) {  // adds the products over k in 32-blocks [b0, b1) into out
  int64_t nb = Kp / BLOCK, groups = Kp / group;
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data()) + m0 * Kp / 4;
  __m512 fa[ROWS][2];
  UNROLL for (int m = 0; m < ROWS; m++) fa[m][0] = fa[m][1] = _mm512_setzero_ps();
  for (int64_t b = b0; b < b1; b++) {
    __m512i ia[ROWS][2];
    UNROLL for (int m = 0; m < ROWS; m++) ia[m][0] = ia[m][1] = _mm512_setzero_si512();
    if constexpr (UNROLLED) {
      UNROLL for (int j = 0; j < BLOCK / 4; j++) k_quad<ROWS, INT4>(w, xq, Kp, b * BLOCK / 4 + j, ia);
    } else {
      for (int64_t kq = b * BLOCK / 4; kq < (b + 1) * BLOCK / 4; kq++) k_quad<ROWS, INT4>(w, xq, Kp, kq, ia);
    }
    if constexpr (INT4) {  // out += d s sum q x, and at a group's end (z - 8 s) sum x
      Int4 f{nullptr, sz, nullptr, group, groups, zeros};
      int64_t g = b * BLOCK / group;
      __m512 s[2] = {f.scale512(g, 0), f.scale512(g, 16)};
      UNROLL for (int m = 0; m < ROWS; m++) {
        __m512 d = _mm512_set1_ps(x.d[(m0 + m) * nb + b]);
        UNROLL for (int j = 0; j < 2; j++)
          fa[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][j]), _mm512_mul_ps(d, s[j]), fa[m][j]);
      }
      if ((b + 1) * BLOCK % group == 0) {
        __m512 offset[2] = {f.offset512(g, 0), f.offset512(g, 16)};
        UNROLL for (int m = 0; m < ROWS; m++) {
          __m512 xs = _mm512_set1_ps(xsum[(m0 + m) * groups + g]);
          UNROLL for (int j = 0; j < 2; j++) fa[m][j] = _mm512_fmadd_ps(offset[j], xs, fa[m][j]);
        }
      }
    } else {  // sum w q = sum (w + 128) q - 128 sum q, times d
      UNROLL for (int m = 0; m < ROWS; m++) {
        __m512 d = _mm512_set1_ps(x.d[(m0 + m) * nb + b]);
        __m512i shift = _mm512_set1_epi32(128 * x.sum[(m0 + m) * nb + b]);
        UNROLL for (int j = 0; j < 2; j++)
          fa[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ia[m][j], shift)), d, fa[m][j]);
      }
    }
  }
  if constexpr (INT4) {
    UNROLL for (int m = 0; m < ROWS; m++)
      UNROLL for (int j = 0; j < 2; j++)
        _mm512_storeu_ps(out[m] + 16 * j, _mm512_add_ps(fa[m][j], _mm512_loadu_ps(out[m] + 16 * j)));
  } else {
    add_group<ROWS>(Int8{nullptr, scales, Kp}, 0, fa, out);
  }
}

// AVX2 has no vpdpbusd: vpmaddubsw multiplies 32 unsigned by 32 signed bytes and sums pairs to
// int16 (saturating), vpmaddwd sums pairs of those to int32. int4: a pair of codes (0..15) times x
// (-127..127) is at most 3810 in size, so a block's 8 k-quads add up in int16 (30480) before one
// vpmaddwd. int8: (w + 128) x would overflow a pair, so the products are |w| times x with w's sign
// (|w| <= 128, |x| <= 127: 32512 at most) and each k-quad widens to int32.
// AVX2 has 16 vector registers. A tile takes a block (32 k) one 32-byte weight vector of each
// k-quad at a time (a pass: int4's 2 x 8 columns, from its nibbles; int8's 8 columns), its rows'
// sums in registers, and adds them, scaled, into out (in L1) at the pass's end; the 8 k-quads of
// a pass are unrolled. The tiles that held all 32 columns' sums for 3 rows at once (and their
// fp32 totals) left GCC 9 of the 12 sums on the stack, stored and loaded again every k-quad.
constexpr int AVX2_INT_ROWS = 4;  // int4: 8 sums, 2 code vectors and 4 of x; int8: 4 sums, w, |w|, x's

template <int ROWS, bool INT4>
AVX2 static void tile_avx2_int(const QuantizedRows& x, int64_t m0, int64_t Kp, const uint8_t* w, const float* scales,
                               const uint16_t* sz, bool zeros, const float* xsum, int64_t group, float (*out)[BLOCK]) {
  int64_t nb = Kp / BLOCK, groups = Kp / group, per_group = group / BLOCK;
  constexpr int64_t QUAD = INT4 ? 64 : 128;  // bytes of a k-quad (32 columns x 4 k)
  constexpr int PASSES = QUAD / 32, V = INT4 ? 2 : 1;  // column vectors in a pass
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data()) + m0 * Kp / 4;
  const float* d = x.d.data() + m0 * nb;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(-128);
  Int4 f{nullptr, sz, nullptr, group, groups, zeros};
  for (int64_t b = 0, g = 0, left = per_group; b < nb; b++) {  // left: blocks to the group's end
    const uint8_t* wb = w + b * (BLOCK / 4) * QUAD;
    bool ends = INT4 && --left == 0;  // a group's end: also out += (z - 8 s) sum x
    if (ends) left = per_group;
    for (int pass = 0; pass < PASSES; pass++) {
      __m256i ia[ROWS][V];
      UNROLL for (int m = 0; m < ROWS; m++)
        UNROLL for (int j = 0; j < V; j++) ia[m][j] = _mm256_setzero_si256();
      UNROLL for (int kq = 0; kq < BLOCK / 4; kq++) {
        const uint8_t* p = wb + kq * QUAD;
        if (pass == 0) {
          prefetch_ahead(p);
          if constexpr (!INT4) prefetch_ahead(p + 64);
        }
        const int32_t* xk = xq + b * BLOCK / 4 + kq;
        __m256i v = _mm256_loadu_si256((const __m256i*)(p + 32 * pass));
        if constexpr (INT4) {  // columns 8 pass.. (low nibbles) and 16 + 8 pass.. (high)
          __m256i c[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
          UNROLL for (int m = 0; m < ROWS; m++) {
            __m256i xb = _mm256_set1_epi32(xk[m * Kp / 4]);
            UNROLL for (int j = 0; j < 2; j++) ia[m][j] = _mm256_add_epi16(ia[m][j], _mm256_maddubs_epi16(c[j], xb));
          }
        } else {  // columns 8 pass..
          v = _mm256_xor_si256(v, top);  // w
          __m256i a = _mm256_abs_epi8(v);
          UNROLL for (int m = 0; m < ROWS; m++) {
            __m256i xb = _mm256_set1_epi32(xk[m * Kp / 4]);
            __m256i pairs = _mm256_maddubs_epi16(a, _mm256_sign_epi8(xb, v));  // |w| (x with w's sign)
            ia[m][0] = _mm256_add_epi32(ia[m][0], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      UNROLL for (int j = 0; j < V; j++) {  // out += d s sum q x (int4), d sum q x (int8)
        int col = 8 * pass + 16 * j;
        __m256 s = INT4 ? f.scale256(g, col) : _mm256_set1_ps(1.f), offset = ends ? f.offset256(g, col) : s;
        UNROLL for (int m = 0; m < ROWS; m++) {
          __m256i sums = INT4 ? _mm256_madd_epi16(ia[m][j], ones) : ia[m][j];
          __m256 ds = _mm256_mul_ps(_mm256_set1_ps(d[m * nb + b]), s);
          __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), ds, _mm256_loadu_ps(out[m] + col));
          if (ends) y = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[(m0 + m) * groups + g]), y);
          _mm256_storeu_ps(out[m] + col, y);
        }
      }
    }
    g += ends;
  }
  if constexpr (!INT4) {  // int8: one scale per column, on sums that began at zero (run clears out)
    UNROLL for (int m = 0; m < ROWS; m++)
      UNROLL for (int j = 0; j < 4; j++)
        _mm256_storeu_ps(out[m] + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(out[m] + 8 * j), _mm256_loadu_ps(scales + 8 * j)));
  }
}

// int8, one row of x (batch-1 decode): a block's 1 KB read once in address order, all 32 columns'
// sums in 4 registers. tile_avx2_int's 4 passes over a block, 32 bytes of every 128 each, read
// memory more slowly at one row (README, How it works). Two k-quads a step: unrolled further, GCC
// kept the sums on the stack.
AVX2 static void row_avx2_int8(const QuantizedRows& x, int64_t m, int64_t Kp, const uint8_t* w, const float* scales,
                               float (*out)[BLOCK]) {
  int64_t nb = Kp / BLOCK;
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data()) + m * Kp / 4;
  const __m256i ones = _mm256_set1_epi16(1), top = _mm256_set1_epi8(-128);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < nb; b++) {
    __m256i ia[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    _Pragma("GCC unroll 2") for (int64_t kq = b * BLOCK / 4; kq < (b + 1) * BLOCK / 4; kq++) {
      const uint8_t* p = w + kq * 128;
      prefetch_ahead(p), prefetch_ahead(p + 64);
      __m256i xb = _mm256_set1_epi32(xq[kq]);
      UNROLL for (int j = 0; j < 4; j++) {  // columns 8 j..
        __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32 * j)), top);  // w
        __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xb, v));
        ia[j] = _mm256_add_epi32(ia[j], _mm256_madd_epi16(pairs, ones));
      }
    }
    __m256 d = _mm256_set1_ps(x.d[m * nb + b]);
    UNROLL for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[j]), d, acc[j]);
  }
  UNROLL for (int j = 0; j < 4; j++) _mm256_storeu_ps(out[0] + 8 * j, _mm256_mul_ps(acc[j], _mm256_loadu_ps(scales + 8 * j)));
}

// bf16 with AVX-512 BF16 dot products: vdpbf16ps adds 2 products of bf16 pairs per fp32 lane,
// twice an fp32 FMA's work, reading the weights as they are. Packed [N / 32, K2, 32, 2] (K2: K
// padded to even, halved): the 2 consecutive k of a column in one 32-bit lane; x is bf16 already.
#define BF16DOT __attribute__((target("avx512f,avx512bf16")))

template <int ROWS>
BF16DOT static void tile_bf16(const uint32_t* x, int64_t K2, int64_t k0, int64_t k1, const uint32_t* w,
                              float (*out)[BLOCK]) {  // adds the products over pairs [k0, k1) into out
  __m512 acc[ROWS][2];
  UNROLL for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k++) {
    prefetch_ahead(w + k * BLOCK, AHEAD<ROWS>), prefetch_ahead(w + k * BLOCK + 16, AHEAD<ROWS>);
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * BLOCK), w1 = (__m512bh)_mm512_loadu_si512(w + k * BLOCK + 16);
    UNROLL for (int m = 0; m < ROWS; m++) {
      __m512bh xk = (__m512bh)_mm512_set1_epi32(x[m * K2 + k]);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xk);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xk);
    }
  }
  UNROLL for (int m = 0; m < ROWS; m++)
    UNROLL for (int j = 0; j < 2; j++)
      _mm512_storeu_ps(out[m] + 16 * j, _mm512_add_ps(acc[m][j], _mm512_loadu_ps(out[m] + 16 * j)));
}

// bf16 on AVX2 (no vdpbf16ps): each 32-bit lane of the pair layout holds k's weight in its low half
// and k + 1's in its high half, and a bf16 is an fp32's top half, so a shift and a mask give both as
// fp32. One or two rows a tile, the whole block a k pair: 8 sums in flight.
template <int ROWS>
AVX2 static void tile_avx2_bf16(const uint32_t* x, int64_t K2, const uint32_t* w, float (*out)[BLOCK]) {
  static_assert(ROWS <= 2, "8 sums, the weights and x: within the 16 registers");
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[ROWS][4];
  UNROLL for (int m = 0; m < ROWS; m++)
    UNROLL for (int i = 0; i < 4; i++) acc[m][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K2; k++) {
    prefetch_ahead(w + k * BLOCK), prefetch_ahead(w + k * BLOCK + 16);
    __m256 even[ROWS], odd[ROWS];
    UNROLL for (int m = 0; m < ROWS; m++) {
      __m256i xk = _mm256_set1_epi32(static_cast<int32_t>(x[m * K2 + k]));
      even[m] = _mm256_castsi256_ps(_mm256_slli_epi32(xk, 16));
      odd[m] = _mm256_castsi256_ps(_mm256_and_si256(xk, high));
    }
    UNROLL for (int i = 0; i < 4; i++) {
      __m256i v = _mm256_loadu_si256((const __m256i*)(w + k * BLOCK + 8 * i));
      __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      UNROLL for (int m = 0; m < ROWS; m++)
        acc[m][i] = _mm256_fmadd_ps(odd[m], wo, _mm256_fmadd_ps(even[m], we, acc[m][i]));
    }
  }
  UNROLL for (int m = 0; m < ROWS; m++)
    UNROLL for (int i = 0; i < 4; i++) _mm256_storeu_ps(out[m] + 8 * i, acc[m][i]);
}

// bf16 on AVX-512 without vdpbf16ps (Xeons before Cooper Lake, VMs that hide AVX-512 BF16): as
// tile_bf16 (up to 8 rows, a panel over_chunks), a k-pair at a time, the pair's weights widened to
// fp32 as in tile_avx2_bf16 and x widened once for the whole product (xf: fp32, 2 K2 a row). On
// tile_avx2_bf16's two rows a tile, a prompt read each block again from L2 for every two rows.
template <int ROWS>
AVX512 static void tile_avx512_bf16(const float* xf, int64_t K2, int64_t k0, int64_t k1, const uint32_t* w,
                                    float (*out)[BLOCK]) {  // adds the products over pairs [k0, k1) into out
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 acc[ROWS][2];
  UNROLL for (int m = 0; m < ROWS; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k++) {
    prefetch_ahead(w + k * BLOCK, AHEAD<ROWS>), prefetch_ahead(w + k * BLOCK + 16, AHEAD<ROWS>);
    __m512 even[2], odd[2];
    UNROLL for (int j = 0; j < 2; j++) {
      __m512i v = _mm512_loadu_si512(w + k * BLOCK + 16 * j);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    UNROLL for (int m = 0; m < ROWS; m++) {
      __m512 xe = _mm512_set1_ps(xf[m * 2 * K2 + 2 * k]), xo = _mm512_set1_ps(xf[m * 2 * K2 + 2 * k + 1]);
      UNROLL for (int j = 0; j < 2; j++) acc[m][j] = _mm512_fmadd_ps(xo, odd[j], _mm512_fmadd_ps(xe, even[j], acc[m][j]));
    }
  }
  UNROLL for (int m = 0; m < ROWS; m++)
    UNROLL for (int j = 0; j < 2; j++)
      _mm512_storeu_ps(out[m] + 16 * j, _mm512_add_ps(acc[m][j], _mm512_loadu_ps(out[m] + 16 * j)));
}

bool has_bf16_dot() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

// AMX (Intel Xeon from Sapphire Rapids on): eight tile registers of up to 16 rows of 64 bytes, and
// one instruction multiplies two of them into a third, a 16 x 16 block of fp32 sums over 32 bf16 k:
// 16x the work of a vdpbf16ps. A bf16 product of AMX_ROWS rows or more (a prompt) runs on them, 32
// rows of x by a block's 32 columns at a time in four tiles of sums. The packed bf16 layout is the
// tiles' B layout already (the 2 k of a column in one 32-bit lane, 16 columns a 64-byte tile row),
// so the weights load as they are stored; x's rows are A. (int8 / int4 on AMX's integer tiles
// measured no faster than the VNNI tiles: their x is scaled per 32 k, so every 32 k the sums
// leave the tiles to be scaled in vector registers, which then take the time.)
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))
constexpr int64_t AMX_ROWS = 16, AMX_TILE = 32;  // rows from which a product runs on AMX; rows a tile
static_assert(AMX_TILE <= PANEL, "an AMX tile's rows are one call's");

bool has_amx() {  // and Linux hands this process the tile state, which it does only when asked
  static const bool ready = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ready;
}

// ldtilecfg's 64 bytes. Tiles 0-3: the sums of x's rows 0-15 / 16-31 by columns 0-15 / 16-31; 4, 5:
// x's rows 0-15 / 16-31, 16 k-pairs each; 6, 7: columns 0-15 / 16-31, 16 k-pairs.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
AMX static void tiles_begin(const TileConfig* c) { _tile_loadconfig(c); }
AMX static void tiles_end() { _tile_release(); }

// GCC's tile intrinsics are asm that does not tell the compiler it reads or writes memory: the
// barriers make the stores into a buffer land before a tile load reads it, and a tile store's data
// be read after it. (A tile instruction's operands are tile numbers, immediates: one line each.)
static inline void memory_barrier() { asm volatile("" ::: "memory"); }

// sums (tiles 0-3) += x's 32 rows (x_stride bytes apart) by w's 32 columns (128 bytes a k-pair)
AMX static inline void tiles_bf16(const void* x, int64_t x_stride, const void* w) {
  memory_barrier();
  _tile_loadd(4, x, x_stride);
  _tile_loadd(5, static_cast<const char*>(x) + 16 * x_stride, x_stride);
  _tile_loadd(6, w, 4 * BLOCK);
  _tile_loadd(7, static_cast<const char*>(w) + 64, 4 * BLOCK);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// bf16: x [32 rows, K2 pairs] by a block [K2, 32 columns] of pairs, 16 pairs a step.
AMX static void tile_amx_bf16(const uint32_t* x, int64_t K2, const uint32_t* w, float (*out)[BLOCK]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  int64_t k = 0;
  for (; k + 16 <= K2; k += 16) tiles_bf16(x + k, K2 * 4, w + k * BLOCK);
  if (k < K2) {  // the last pairs, zero-padded to a whole tile
    alignas(64) uint32_t xt[AMX_TILE][16] = {}, wt[16][BLOCK] = {};
    for (int64_t r = 0; r < AMX_TILE; r++) std::copy(x + r * K2 + k, x + (r + 1) * K2, xt[r]);
    std::copy(w + k * BLOCK, w + K2 * BLOCK, wt[0]);
    tiles_bf16(xt, 64, wt);
  }
  _tile_stored(0, out[0], 4 * BLOCK);
  _tile_stored(1, out[0] + 16, 4 * BLOCK);
  _tile_stored(2, out[16], 4 * BLOCK);
  _tile_stored(3, out[16] + 16, 4 * BLOCK);
  memory_barrier();
}

// The ops' isa argument (kernels.ISA_CODES).
constexpr int64_t ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AVX512VNNI = 2;
// Where int8 / int4 are integer products, on their layout (kernels.INTEGER_ISAS).
static bool integer_products(int64_t isa) { return isa == ISA_AVX512VNNI || isa == ISA_AVX2; }
static const char* isa_name(int64_t isa) {
  return isa == ISA_AVX2 ? "avx2" : isa == ISA_AVX512 ? "avx512" : isa == ISA_AVX512VNNI ? "avx512vnni" : "?";
}

// "avx512vnni", "avx512", "avx2" or "" (none: kernels.py does not pack then).
std::string best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return "avx512vnni";
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "";
}

// fp32 sums -> bf16 as c10::BFloat16 rounds them (to nearest even; NaN -> 0x7FC0), 16 at a time where
// the CPU has AVX-512: one at a time, the rounding took a visible part of a long prompt's products.
// (simd.h's store16 rounds alike but leaves NaN's bits to the rounding, so a NaN sum came out with
// other bits than c10's.)
AVX512 static void to_bf16_avx512(const float* in, int64_t n, uint16_t* out) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(in + i);
    __m512i u = _mm512_castps_si512(v);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), one), half);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  std::copy(in + i, in + n, reinterpret_cast<at::BFloat16*>(out) + i);
}

static void to_bf16(const float* in, int64_t n, uint16_t* out, int64_t isa) {
  if (isa != ISA_AVX2) return to_bf16_avx512(in, n, out);
  std::copy(in, in + n, reinterpret_cast<at::BFloat16*>(out));
}

// Bytes of x's rows that a product goes over before the next rows: a long prompt's x (32 MB: 1024
// rows of 8192 fp32) read whole for every block (or group of blocks, below) came from memory, not
// from L3; in groups of rows the weights come from memory once a group instead.
constexpr int64_t ROW_GROUP_BYTES = 4 << 20;

// Weights of the blocks that each tile of a group of rows goes over before the next group of
// blocks, where that group of rows is over half of L2: half of L2, so that the blocks stay there
// while every tile of rows passes, and each tile's rows stay there over the group's blocks. A tile
// going over every block in turn read all the group's rows (4 MB: 1024 rows of 2048 bf16) from L3
// for every block.
static int64_t block_group_bytes() {
  static const int64_t bytes = [] {
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) / 2 : int64_t(512) << 10;
  }();
  return bytes;
}

// y [..., N] (x's shape and dtype; its M rows flattened) over blocks of 32 output columns (of
// block_bytes each) split between threads, each in tiles of up to rows_per_tile rows of x: tile(b,
// m, rows, out) writes rows m.. of block b into out. tiles: AMX's configuration, which each thread
// loads (nullptr: none).
template <class Tile>
static at::Tensor run(int64_t M, int64_t N, int64_t blocks, int64_t block_bytes, int64_t rows_per_tile,
                      const at::Tensor& x, int64_t isa, Tile tile, const TileConfig* tiles = nullptr) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = at::empty(shape, x.options());  // fp32, or bf16 (rounded from the fp32 sums)
  bool bf16 = y.scalar_type() == at::kBFloat16;
  char* yp = static_cast<char*>(y.data_ptr());
  int64_t row_bytes = x.size(-1) * x.element_size();
  int64_t rows_group = std::max<int64_t>(1, ROW_GROUP_BYTES / row_bytes / rows_per_tile) * rows_per_tile;
  bool in_l2 = std::min(M, rows_group) * row_bytes <= block_group_bytes();
  int64_t group = in_l2 ? 1 : std::max<int64_t>(1, block_group_bytes() / block_bytes);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float out[PANEL][BLOCK];
    if (tiles) tiles_begin(tiles);
    for (int64_t m0 = 0; m0 < M; m0 += rows_group) {
      for (int64_t g = b0; g < b1; g += group) {
        for (int64_t m = m0; m < std::min(M, m0 + rows_group); m += rows_per_tile) {
          int64_t rows = std::min(rows_per_tile, M - m);
          for (int64_t b = g; b < std::min(b1, g + group); b++) {
            int64_t columns = std::min(BLOCK, N - b * BLOCK);
            std::memset(out, 0, rows * sizeof(out[0]));
            tile(b, m, rows, out);
            for (int64_t r = 0; r < rows; r++) {
              int64_t at = (m + r) * N + b * BLOCK;
              if (bf16)
                to_bf16(out[r], columns, reinterpret_cast<uint16_t*>(yp) + at, isa);
              else
                std::memcpy(reinterpret_cast<float*>(yp) + at, out[r], columns * sizeof(float));
            }
          }
        }
      }
    }
    if (tiles) tiles_end();
  });
  return y;
}

// The fp32-FMA tiles for a weight format W (`format(b, m)`: block b's, for rows from m).
template <class Format>
static at::Tensor run_fma(const at::Tensor& x, int64_t N, int64_t blocks, int64_t block_bytes, int64_t isa,
                          Format format) {
  bool wide = isa == ISA_AVX512 || isa == ISA_AVX512VNNI;
  TORCH_CHECK(wide || isa == ISA_AVX2, "kernels: unknown instruction set ", isa);
  int64_t K = x.size(-1);
  const float* xp = x.data_ptr<float>();
  int64_t M = x.numel() / K;
  int64_t rows_per_tile = wide ? PANEL : M <= 2 ? 2 : PROMPT_ROWS;
  auto tile = [&](int64_t b, int64_t m, int64_t rows, float (*out)[BLOCK]) {
    auto w = format(b, m);
    if (wide)
      over_chunks<8>(M, rows, K, w.chunk(), [&](auto R, int64_t i, int64_t k0, int64_t k1) {
        tile_avx512<decltype(R)::value>(xp + (m + i) * K, K, k0, k1, format(b, m + i), out + i);
      });
    else if constexpr (std::is_same_v<decltype(w), F32>) {  // int8 / int4 have integer products on AVX2
      if (rows <= 2)
        with_rows<1, 2>(rows, [&](auto R) { tile_avx2_decode<decltype(R)::value>(xp + m * K, K, w, out); });
      else
        prompt_avx2(xp + m * K, K, rows, w, out);
    }
  };
  return run(M, N, blocks, block_bytes, rows_per_tile, x, isa, tile);
}

template <bool INT4>
static at::Tensor run_integer(const at::Tensor& x, int64_t N, int64_t blocks, int64_t Kp, const uint8_t* w,
                              const float* scales, const uint16_t* sz, bool zeros, int64_t group, int64_t isa) {
  int64_t K = x.size(-1), M = x.numel() / K, bytes = INT4 ? BLOCK / 2 : BLOCK, nb = Kp / BLOCK;
  QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K, Kp);
  // int4's zero term takes the sums of the rounded x too, so that the rounding's error is
  // d(x) * w as for int8, not d(x) * (q s), which is off-centre by 8 s.
  std::vector<float> xsum(INT4 ? M * (Kp / group) : 0);
  for (int64_t m = 0; m < M && INT4; m++)
    for (int64_t b = 0; b < nb; b++) xsum[m * (Kp / group) + b * BLOCK / group] += xq.d[m * nb + b] * xq.sum[m * nb + b];
  bool vnni = isa == ISA_AVX512VNNI;
  int64_t rows_per_tile = vnni ? PANEL : AVX2_INT_ROWS;
  auto tile = [&](int64_t b, int64_t m, int64_t rows, float (*out)[BLOCK]) {
    const uint8_t* wb = w + b * Kp * bytes;
    const float* sb = INT4 ? nullptr : scales + b * BLOCK;
    const uint16_t* szb = INT4 ? sz + b * (Kp / group) * sz_per_group(zeros) : nullptr;
    if (vnni)
      over_chunks<4>(M, rows, nb, CHUNK_BYTES / (BLOCK * bytes), [&](auto R, int64_t i, int64_t b0, int64_t b1) {
        auto tile = [&](auto unrolled) {
          tile_vnni<decltype(R)::value, INT4, decltype(unrolled)::value>(xq, m + i, Kp, b0, b1, wb, sb, szb, zeros,
                                                                          xsum.data(), group, out + i);
        };
        // a prompt's tiles unrolled; a decode step's or a batch's (a panel, over_chunks) as a loop
        M > PANEL ? tile(std::true_type{}) : tile(std::false_type{});
      });
    else if (!INT4 && rows == 1)
      row_avx2_int8(xq, m, Kp, wb, sb, out);
    else
      with_rows<1, AVX2_INT_ROWS>(rows, [&](auto R) {
        tile_avx2_int<decltype(R)::value, INT4>(xq, m, Kp, wb, sb, szb, zeros, xsum.data(), group, out);
      });
  };
  return run(M, N, blocks, Kp * bytes, rows_per_tile, x, isa, tile);
}

// x's rows, read in place where x is contiguous (the usual case; contiguous() then returns x
// without a dispatch): no reshape or view through the dispatcher, whose calls add up over the few
// hundred products of a small model's step.
static at::Tensor rows_of(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == K, "kernels: x must be float32 with ",
              K, " features");
  return x.contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  int64_t blocks = packed.size(0), K = packed.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == BLOCK &&
              blocks * BLOCK >= N, "packed_linear: a float32 weight packed [N / 32, K, 32]");
  auto x2 = rows_of(x, K);
  const float* wp = packed.data_ptr<float>();
  return run_fma(x2, N, blocks, K * BLOCK * 4, isa, [&](int64_t b, int64_t m) { return F32{wp + b * K * BLOCK, K}; });
}

// int8: packed int8 [N / 32, K, 32] (AVX-512 FMA), or uint8 [N / 32, Kp / 4, 32, 4] holding w + 128
// (integer products: VNNI, AVX2).
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                       int64_t isa) {
  bool integer = integer_products(isa);
  int64_t blocks = packed.size(0), K = x.size(-1), Kp = integer ? packed.size(1) * 4 : packed.size(1);
  TORCH_CHECK(integer ? packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == BLOCK &&
                         packed.size(3) == 4 && Kp == (K + BLOCK - 1) / BLOCK * BLOCK
                   : packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == BLOCK && Kp == K,
              "packed_linear_int8: a weight packed for ", isa_name(isa), " with ", K, " input features");
  TORCH_CHECK(blocks * BLOCK >= N && scales.scalar_type() == at::kFloat && scales.numel() == blocks * BLOCK &&
              scales.is_contiguous(), "packed_linear_int8: float32 scales, one per packed column");
  auto x2 = rows_of(x, K);
  const float* sp = scales.data_ptr<float>();
  if (integer) return run_integer<false>(x2, N, blocks, Kp, packed.data_ptr<uint8_t>(), sp, nullptr, false, Kp, isa);
  const int8_t* wp = packed.data_ptr<int8_t>();
  return run_fma(x2, N, blocks, K * BLOCK, isa,
                 [&](int64_t b, int64_t m) { return Int8{wp + b * K * BLOCK, sp + b * BLOCK, K}; });
}

// int4: packed uint8 [N / 32, Kp, 16] (AVX-512 FMA) or [N / 32, Kp / 4, 16, 4] (VNNI, AVX2), Kp: K padded to
// whole groups (x may have fewer features: the padding meets no x); bf16 scales and zeros
// [N / 32, groups, 2, 32], or scales alone [N / 32, groups, 32] where every zero is 0.
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t N,
                       int64_t isa) {
  bool integer = integer_products(isa);
  int64_t blocks = packed.size(0), Kp = integer ? packed.size(1) * 4 : packed.size(1), groups = sz.size(1),
          K = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == (integer ? 4 : 3) &&
              packed.size(2) == BLOCK / 2 && (!integer || packed.size(3) == 4) && blocks * BLOCK >= N,
              "packed_linear_int4: a uint8 weight packed for ", isa_name(isa));
  bool zeros = sz.dim() == 4;
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && (zeros ? sz.size(2) == 2 : sz.dim() == 3) &&
              sz.size(0) == blocks && sz.size(-1) == BLOCK && sz.is_contiguous() && Kp % groups == 0 &&
              Kp / groups % BLOCK == 0, "packed_linear_int4: bf16 scales and zeros packed [N / 32, groups, 2, 32], "
              "or scales [N / 32, groups, 32], of groups of 32k columns");
  int64_t group = Kp / groups;
  TORCH_CHECK(K <= Kp && K > Kp - group, "packed_linear_int4: x has ", K, " features for ", Kp, " packed ones");
  auto x2 = rows_of(x, K);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  if (integer) return run_integer<true>(x2, N, blocks, Kp, wp, nullptr, sp, zeros, group, isa);
  int64_t M = x2.numel() / K;
  std::vector<float> xs(M * groups);  // sum of each row's x over each group
  const float* xp = x2.data_ptr<float>();
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k++) xs[m * groups + k / group] += xp[m * K + k];
  return run_fma(x2, N, blocks, Kp * BLOCK / 2, isa, [&](int64_t b, int64_t m) {
    return Int4{wp + b * Kp * BLOCK / 2, sp + b * groups * sz_per_group(zeros), xs.data() + m * groups, group,
                groups, zeros};
  });
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t isa) {
  int64_t blocks = packed.size(0), K2 = packed.size(1), K = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == BLOCK &&
              packed.size(3) == 2 && blocks * BLOCK >= N && K2 == (K + 1) / 2,
              "packed_linear_bf16: a bf16 weight packed [N / 32, K / 2, 32, 2] for ", K, " input features");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "packed_linear_bf16: x must be bf16");
  TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512 || isa == ISA_AVX512VNNI, "kernels: unknown instruction set ", isa);
  static const bool bf16_dot = has_bf16_dot();  // asked once, not on every call of a decode step
  // vdpbf16ps, and AMX for a prompt's rows. Every CPU with AVX-512 BF16 has VNNI, so the plain
  // AVX-512 level (Skylake's) widens, as such a CPU must: its tests run on every AVX-512 CPU.
  bool dot = bf16_dot && isa == ISA_AVX512VNNI;
  int64_t M = x.numel() / K;
  bool amx = dot && M >= AMX_ROWS && has_amx();
  // Whole pairs, and for AMX whole tiles of rows (zeros).
  int64_t pad_rows = amx ? (M + AMX_TILE - 1) / AMX_TILE * AMX_TILE - M : 0;
  auto x2 = K % 2 || pad_rows ? at::constant_pad_nd(x.reshape({M, K}), {0, K % 2, 0, pad_rows}) : x.contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x2.data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  int64_t block_bytes = K2 * BLOCK * 4;
  if (amx) {
    static const TileConfig tiles{};
    auto tile = [&](int64_t b, int64_t m, int64_t rows, float (*out)[BLOCK]) {
      tile_amx_bf16(xp + m * K2, K2, wp + b * K2 * BLOCK, out);
    };
    return run(M, N, blocks, block_bytes, AMX_TILE, x, isa, tile, &tiles);
  }
  if (!dot && isa != ISA_AVX2) {
    // x widened here, not by a dispatched to(): a decode step makes a few hundred of these calls
    const at::BFloat16* xb = x2.data_ptr<at::BFloat16>();
    std::vector<float> xf(xb, xb + M * 2 * K2);
    const float* xfp = xf.data();
    return run(M, N, blocks, block_bytes, PANEL, x, isa, [&](int64_t b, int64_t m, int64_t rows, float (*out)[BLOCK]) {
      over_chunks<8>(M, rows, K2, CHUNK_BYTES / (BLOCK * 4), [&](auto R, int64_t i, int64_t k0, int64_t k1) {
        tile_avx512_bf16<decltype(R)::value>(xfp + (m + i) * 2 * K2, K2, k0, k1, wp + b * K2 * BLOCK, out + i);
      });
    });
  }
  if (!dot)
    return run(M, N, blocks, block_bytes, 2, x, isa, [&](int64_t b, int64_t m, int64_t rows, float (*out)[BLOCK]) {
      with_rows<1, 2>(rows, [&](auto R) {
        tile_avx2_bf16<decltype(R)::value>(xp + m * K2, K2, wp + b * K2 * BLOCK, out);
      });
    });
  return run(M, N, blocks, block_bytes, PANEL, x, isa, [&](int64_t b, int64_t m, int64_t rows, float (*out)[BLOCK]) {
    over_chunks<8>(M, rows, K2, CHUNK_BYTES / (BLOCK * 4), [&](auto R, int64_t i, int64_t k0, int64_t k1) {
      tile_bf16<decltype(R)::value>(xp + (m + i) * K2, K2, k0, k1, wp + b * K2 * BLOCK, out + i);
    });
  });
}

// Rows of the embedding tied to a packed output projection: row i is column i % 32 of block i / 32.
template <class T>
static void gather_columns(const int64_t* ids, int64_t n, const T* p, int64_t K, bool pairs, int64_t dim, T* out) {
  for (int64_t r = 0; r < n; r++) {
    const T* block = p + ids[r] / BLOCK * K * BLOCK;
    int64_t c = ids[r] % BLOCK;
    for (int64_t k = 0; k < dim; k++)
      out[r * dim + k] = pairs ? block[(k / 2 * BLOCK + c) * 2 + k % 2] : block[k * BLOCK + c];
  }
}

// An embedding lookup's indices as int64, each checked against the rows packed, and its output
// [*idx.shape, dim].
static std::pair<at::Tensor, at::Tensor> lookup(const at::Tensor& idx, int64_t rows, int64_t dim,
                                                at::TensorOptions options, const char* op) {
  auto ids = idx.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.numel(); r++)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < rows, op, ": index ", ip[r], " out of range");
  auto shape = idx.sizes().vec();
  shape.push_back(dim);
  return {ids, at::empty(shape, options)};
}

at::Tensor packed_embedding(const at::Tensor& idx, const at::Tensor& packed, int64_t dim) {
  bool pairs = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(pairs ? packed.dim() == 4 && packed.size(3) == 2 : packed.scalar_type() == at::kFloat && packed.dim() == 3,
              "packed_embedding: a weight packed by kernels.py");
  int64_t K = pairs ? packed.size(1) * 2 : packed.size(1), rows = packed.size(0) * BLOCK;
  TORCH_CHECK(dim <= K, "packed_embedding: ", dim, " features of ", K);
  auto [ids, out] = lookup(idx, rows, dim, packed.options(), "packed_embedding");
  const int64_t* ip = ids.data_ptr<int64_t>();
  if (pairs)
    gather_columns(ip, ids.numel(), packed.data_ptr<at::BFloat16>(), K, true, dim, out.data_ptr<at::BFloat16>());
  else
    gather_columns(ip, ids.numel(), packed.data_ptr<float>(), K, false, dim, out.data_ptr<float>());
  return out;
}

// Rows of the embedding tied to a packed int8 output projection (pack_int8's layouts), times their
// scales, in fp32.
at::Tensor packed_embedding_int8(const at::Tensor& idx, const at::Tensor& packed, const at::Tensor& scales,
                                 int64_t dim) {
  bool lanes = packed.dim() == 4;  // INTEGER_ISAS: uint8 w + 128 [N / 32, Kp / 4, 32, 4]; else int8 [N / 32, K, 32]
  TORCH_CHECK(lanes ? packed.scalar_type() == at::kByte && packed.size(2) == BLOCK && packed.size(3) == 4
                    : packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == BLOCK,
              "packed_embedding_int8: a weight packed by kernels.pack_int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == packed.size(0) * BLOCK &&
                  packed.is_contiguous() && scales.is_contiguous(),
              "packed_embedding_int8: fp32 scales, one per packed row");
  int64_t K = lanes ? packed.size(1) * 4 : packed.size(1), rows = packed.size(0) * BLOCK;
  TORCH_CHECK(dim <= K, "packed_embedding_int8: ", dim, " features of ", K);
  auto [ids, out] = lookup(idx, rows, dim, at::dtype(at::kFloat), "packed_embedding_int8");
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* p = (const uint8_t*)packed.data_ptr();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < ids.numel(); r++) {
    int64_t b = ip[r] / BLOCK, c = ip[r] % BLOCK;
    const uint8_t* block = p + b * K * BLOCK;
    for (int64_t k = 0; k < dim; k++) {
      int q = lanes ? (int)block[(k / 4 * BLOCK + c) * 4 + k % 4] - 128 : (int)(int8_t)block[k * BLOCK + c];
      o[r * dim + k] = (float)q * s[ip[r]];
    }
  }
  return out;
}

// Rows of the embedding tied to a packed int4 output projection (pack_int4's layouts), dequantized
// as dequantize_int4 does, (code - 8) * scale + zero, in fp32.
at::Tensor packed_embedding_int4(const at::Tensor& idx, const at::Tensor& packed, const at::Tensor& sz,
                                 int64_t dim) {
  bool lanes = packed.dim() == 4;  // INTEGER_ISAS: [N / 32, Kp / 4, 16, 4]; else [N / 32, Kp, 16]
  TORCH_CHECK(packed.scalar_type() == at::kByte && (lanes ? packed.size(3) == 4 : packed.dim() == 3) &&
                  packed.size(2) == BLOCK / 2,
              "packed_embedding_int4: a weight packed by kernels.pack_int4");
  bool zeros = sz.dim() == 4;  // [N / 32, G, 2, 32]; or the scales alone, [N / 32, G, 32]
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.size(0) == packed.size(0) && sz.size(-1) == BLOCK &&
                  (zeros ? sz.size(2) == 2 : sz.dim() == 3) && packed.is_contiguous() && sz.is_contiguous(),
              "packed_embedding_int4: scales (and zeros) packed by kernels.pack_int4");
  int64_t K = lanes ? packed.size(1) * 4 : packed.size(1), rows = packed.size(0) * BLOCK, G = sz.size(1);
  TORCH_CHECK(K % G == 0 && dim <= K, "packed_embedding_int4: ", dim, " features of ", K, " in ", G, " groups");
  int64_t group = K / G, stride = sz_per_group(zeros);
  auto [ids, out] = lookup(idx, rows, dim, at::dtype(at::kFloat), "packed_embedding_int4");
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const at::BFloat16* s = sz.data_ptr<at::BFloat16>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < ids.numel(); r++) {
    int64_t b = ip[r] / BLOCK, c = ip[r] % BLOCK, j = c % (BLOCK / 2), shift = c < BLOCK / 2 ? 0 : 4;
    const uint8_t* block = p + b * K * (BLOCK / 2);
    for (int64_t k = 0; k < dim; k++) {
      int code = (lanes ? block[(k / 4 * (BLOCK / 2) + j) * 4 + k % 4] : block[k * (BLOCK / 2) + j]) >> shift & 15;
      const at::BFloat16* g = s + (b * G + k / group) * stride;
      float scale = g[c], zero = zeros ? (float)g[BLOCK + c] : 0.f;
      o[r * dim + k] = (float)(code - 8) * scale + zero;
    }
  }
  return out;
}

bool attention_supported();  // attention.cpp

// Operators of torch's own registry, so that a compiled graph calls the kernels without passing
// through Python (kernels.py adds the shape functions torch.compile traces with).
TORCH_LIBRARY(brisk, m) {
  // What the CPU can run, asked once by kernels.py.
  m.def("best_isa() -> str", &best_isa);
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("attention_supported() -> bool", &attention_supported);
  // isa: kernels.ISA_CODES. An int, not the name: inductor's C++ wrapper calls ops whose arguments
  // are all tensors and numbers through a light C call, a string through heavy boxed dispatch code
  // (a minute longer to compile a 30-layer step).
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, int isa) -> Tensor");
  m.def("packed_linear_int8(Tensor x, Tensor packed, Tensor scales, int out_features, int isa) -> Tensor");
  m.def("packed_linear_int4(Tensor x, Tensor packed, Tensor scales_and_zeros, int out_features, int isa) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor packed, int out_features, int isa) -> Tensor");
  m.def("packed_embedding(Tensor idx, Tensor packed, int dim) -> Tensor");
  m.def("packed_embedding_int8(Tensor idx, Tensor packed, Tensor scales, int dim) -> Tensor");
  m.def("packed_embedding_int4(Tensor idx, Tensor packed, Tensor scales_and_zeros, int dim) -> Tensor");
}
TORCH_LIBRARY_IMPL(brisk, CPU, m) {
  m.impl("packed_linear", &linear);
  m.impl("packed_linear_int8", &linear_int8);
  m.impl("packed_linear_int4", &linear_int4);
  m.impl("packed_linear_bf16", &linear_bf16);
  m.impl("packed_embedding", &packed_embedding);
  m.impl("packed_embedding_int8", &packed_embedding_int8);
  m.impl("packed_embedding_int4", &packed_embedding_int4);
}
