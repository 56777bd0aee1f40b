// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// Attention of a decode step: a few query rows per sequence (the query heads that share a key/value
// head, times the step's tokens) against that sequence's KV cache row, read in place.
//
// The time of a decode step at a long context goes here: every step reads the whole cache. Each
// key and value vector is read once, for all query rows of its head, and the positions are split
// between the threads in chunks (flash-decoding): a chunk keeps its own running maximum, sum of
// exponentials and weighted sum of values, and the chunks of a head are merged at the end, so
// that even one sequence with three key/value heads keeps both cores busy. And a prompt's causal
// attention from position 0 over its own keys (prefill; further down).
// Built with kernels.cpp into one extension (kernels.py); AVX-512 or AVX2, by the ops' isa argument.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t MAX_ROWS = 16;  // query rows per key/value head (heads per group x tokens)
constexpr int64_t MIN_CHUNK = 64;  // positions: fewer make the merge cost more than it saves
constexpr int64_t AHEAD = 8;  // keys ahead of their use that a decode step asks the memory for

// 64 bits of n <= 64 (the first n set).
inline uint64_t first64(int64_t n) { return n <= 0 ? 0 : n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; }

// Which of the n <= 64 mask bytes at v are true, a bit each. SSE2 (every x86-64): both instruction
// sets' code calls it, and it costs little beside the scores of the keys it masks.
inline uint64_t true_bits(const bool* v, int64_t n) {
  n = std::min<int64_t>(n, 64);
  uint64_t bits = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i));
    bits |= uint64_t(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_setzero_si128())) ^ 0xffff) << i;
  }
  for (; i < n; i++) bits |= uint64_t(v[i] ? 1 : 0) << i;
  return bits;
}

// The positions a mask row of S shows, [first, last) from its first true to one past its last
// (first == last: none), 64 at a time: a decode step's mask spans the whole cache (an engine's
// slots of thousands of positions), of which a short sequence sees its first few.
inline void visible_span(const bool* v, int64_t S, int64_t& first, int64_t& last) {
  first = last = S;
  for (int64_t s = 0; s < S; s += 64) {
    if (uint64_t m = true_bits(v + s, S - s)) {
      first = s + __builtin_ctzll(m);
      break;
    }
  }
  for (int64_t e = S; e > first; e -= 64) {
    int64_t s = std::max(first, e - 64);
    if (uint64_t m = true_bits(v + s, e - s)) {
      last = s + 64 - __builtin_clzll(m);
      return;
    }
  }
  last = first;
}

struct Partial {  // one chunk of positions, per query row: max score, sum of exponentials, sum p v
  float max[MAX_ROWS], sum[MAX_ROWS];
};

template <int MAX, int R = 1, class F>
void with_rows(int64_t rows, F&& f) {  // f(std::integral_constant<int, rows>), rows <= MAX
  if constexpr (R < MAX) {
    if (rows != R) return with_rows<MAX, R + 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// The sums of 16 vectors as one: lane i is the sum of v[i]'s 16 values. A tree of shuffles and
// adds (45 instructions) where 16 separate reductions would take over a hundred.
AVX512 inline __m512 sum16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; i++)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; j++)  // per lane: that lane's sum of v[4j .. 4j+3]
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Lanes across: lane j of the result sums lanes 0-3 of quads[j].
  __m512 g0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 g1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(g0, g1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(g0, g1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of query row qr against the n <= 16 key vectors at k (row stride D), lane i for k[i].
template <int VECS, class T>
AVX512 inline __m512 scores16(const __m512* qr, const T* k, int64_t D, int64_t n) {
  __m512 dot[16];
  for (int i = 0; i < 16; i++) {
    dot[i] = _mm512_setzero_ps();
    if (i < n)
      for (int j = 0; j < VECS; j++) dot[i] = _mm512_fmadd_ps(qr[j], load16(k + i * D + 16 * j, D - 16 * j), dot[i]);
  }
  return sum16(dot);
}

// Query rows q [R, VECS * 16] (fp32, zero-padded) against positions [s0, s1) of one cache row's head
// k, v [S, D]; visible[r * S + s] says which positions row r sees. Writes part and acc [R, VECS * 16].
// scores: room for ceil(R / GROUP) * GROUP rows of s1 - s0 positions rounded up to 16.
// Each block of 16 keys and each value vector is read from memory once for all rows (then from the
// core's cache); VECS vectors of 16 features are a compile-time count, so that sums stay in registers.
template <int VECS, class T>
AVX512 void attend_chunk(const float* q, int64_t R, int64_t D, const T* k, const T* v, const bool* visible,
                         int64_t S, int64_t s0, int64_t s1, float scale, float* scores, Partial& part, float* acc) {
  constexpr int GROUP = VECS >= 16 ? 1 : 16 / VECS;  // rows whose sums of p v fit in registers together
  const int64_t n = s1 - s0, stride = (n + 15) / 16 * 16;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top[MAX_ROWS];
  for (int64_t r = 0; r < R; r++) top[r] = minus_inf;
  for (int64_t b = 0; b < n; b += 16) {  // scores, 16 positions at a time; -inf where masked
    int64_t m = std::min<int64_t>(16, n - b);
    for (int64_t r = 0; r < R; r++) {
      __m512 qr[VECS];
      for (int j = 0; j < VECS; j++) qr[j] = _mm512_loadu_ps(q + (r * VECS + j) * 16);
      // A whole block passes the constant 16: inlined, its keys need no bound check.
      __m512 sc = _mm512_mul_ps(m == 16 ? scores16<VECS>(qr, k + (s0 + b) * D, D, 16)
                                        : scores16<VECS>(qr, k + (s0 + b) * D, D, m), _mm512_set1_ps(scale));
      __m128i vis = _mm_maskz_loadu_epi8(first(m), visible + r * S + s0 + b);
      sc = _mm512_mask_blend_ps(_mm_test_epi8_mask(vis, vis), minus_inf, sc);
      _mm512_storeu_ps(scores + r * stride + b, sc);
      top[r] = _mm512_max_ps(top[r], sc);
    }
  }
  for (int64_t r = 0; r < R; r++) {  // exponentials (0 where masked) and their sum
    float* row = scores + r * stride;
    part.max[r] = _mm512_reduce_max_ps(top[r]);
    __m512 mx = _mm512_set1_ps(std::isinf(part.max[r]) ? 0.f : part.max[r]), total = _mm512_setzero_ps();
    for (int64_t i = 0; i < stride; i += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), mx));
      _mm512_storeu_ps(row + i, e);
      total = _mm512_add_ps(total, e);
    }
    part.sum[r] = _mm512_reduce_add_ps(total);
  }
  for (int64_t r = R; r < (R + GROUP - 1) / GROUP * GROUP; r++)  // rows past R weigh nothing
    std::fill(scores + r * stride, scores + r * stride + n, 0.f);
  for (int64_t r0 = 0; r0 < R; r0 += GROUP) {  // sums of p v, GROUP rows at a time
    __m512 a[GROUP][VECS];
    for (int g = 0; g < GROUP; g++)
      for (int j = 0; j < VECS; j++) a[g][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s++) {
      __m512 vs[VECS];
      for (int j = 0; j < VECS; j++) vs[j] = load16(v + (s0 + s) * D + 16 * j, D - 16 * j);
      for (int g = 0; g < GROUP; g++) {
        float p = scores[(r0 + g) * stride + s];
        __mmask16 use = p != 0.f ? (__mmask16)0xffff : (__mmask16)0;  // a masked value is never added
        __m512 ps = _mm512_set1_ps(p);
        for (int j = 0; j < VECS; j++) a[g][j] = _mm512_mask3_fmadd_ps(ps, vs[j], a[g][j], use);
      }
    }
    for (int g = 0; g < GROUP && r0 + g < R; g++)
      for (int j = 0; j < VECS; j++) _mm512_storeu_ps(acc + ((r0 + g) * VECS + j) * 16, a[g][j]);
  }
}

// The sums of 8 vectors as one: lane i is the sum of v[i]'s 8 values (AVX2's sum16).
AVX2 inline __m256 sum8x8(const __m256* v) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // per half: v0..v3
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // per half: v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lanes 8 j .. 8 j + 7 of 64 bits as a mask of 8 lanes (all ones where the bit is set).
AVX2 inline __m256 lanes8(uint64_t bits, int j) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i b = _mm256_and_si256(_mm256_set1_epi32(int(bits >> (8 * j) & 0xff)), bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
}

// The first m <= 8 mask bytes at v as a mask of 8 lanes (lanes past m: none).
AVX2 inline __m256 visible8(const bool* v, int64_t m) {
  uint64_t bytes = 0;
  std::memcpy(&bytes, v, m);
  __m256i lanes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes)));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpeq_epi32(lanes, _mm256_setzero_si256()),
                                              _mm256_set1_epi32(-1)));
}

AVX2 inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// AVX2 has 16 registers: the rows of a decode step (heads per group x tokens) go CHUNK_ROWS at a
// time, each key's and value's vectors loaded once for all of them, with enough independent sums
// (8: keys x rows in scores, vectors x rows in values) to keep both FMA units busy. Heads of whole
// vectors (WHOLE: D a multiple of 8, every model's) load without bound checks: checked, GCC kept
// the sums on the stack.
constexpr int CHUNK_ROWS = 4;
constexpr int64_t VALUE_KEYS = 32;  // keys whose values stay in L1 while each group of vectors takes its turn

// Keys (scores) or vectors of features (values) a tile of `rows` rows takes at a time: 8 sums or more.
constexpr int per_row(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : 2; }

// Lane-wise products of ROWS query rows (q, `width` apart) with the keys at k (D features each; n
// of them, 8 - n past the end are the last one again): sums[8 r + i]'s lanes add up to row r's
// score of key i (sum8x8 adds them).
template <int ROWS, bool WHOLE, class T>
AVX2 inline void dots8(const float* q, int64_t width, int64_t D, const T* k, int64_t n, __m256* sums) {
  constexpr int KEYS = per_row(ROWS);
  for (int i0 = 0; i0 < 8; i0 += KEYS) {
    const T* key[KEYS];
    UNROLL for (int i = 0; i < KEYS; i++) key[i] = k + std::min<int64_t>(i0 + i, n - 1) * D;
    __m256 acc[ROWS][KEYS];
    UNROLL for (int r = 0; r < ROWS; r++)
      UNROLL for (int i = 0; i < KEYS; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 8) {
      __m256 qr[ROWS];
      UNROLL for (int r = 0; r < ROWS; r++) qr[r] = _mm256_loadu_ps(q + r * width + j);
      UNROLL for (int i = 0; i < KEYS; i++) {
        __m256 kv = load8(key[i] + j, WHOLE ? 8 : D - j);
        UNROLL for (int r = 0; r < ROWS; r++) acc[r][i] = _mm256_fmadd_ps(qr[r], kv, acc[r][i]);
      }
    }
    UNROLL for (int r = 0; r < ROWS; r++)
      UNROLL for (int i = 0; i < KEYS; i++) sums[8 * r + i0 + i] = acc[r][i];
  }
}

// o[r, c : c + 8 VECS] += sum over s < n of p[r, s] v[s, c : c + 8 VECS], for ROWS rows (p `stride`
// apart, o `width` apart) and c + 8 VECS <= D rounded up to 8. A masked position's p is 0: its
// value, finite, adds nothing.
template <int ROWS, int VECS, bool WHOLE, class T>
AVX2 inline void values8(const float* p, int64_t stride, int64_t n, const T* v, int64_t D, int64_t c, float* o,
                         int64_t width) {
  __m256 acc[ROWS][VECS];
  UNROLL for (int r = 0; r < ROWS; r++)
    UNROLL for (int j = 0; j < VECS; j++) acc[r][j] = _mm256_loadu_ps(o + r * width + c + 8 * j);
  for (int64_t s = 0; s < n; s++) {
    __m256 vs[VECS];
    UNROLL for (int j = 0; j < VECS; j++) vs[j] = load8(v + s * D + c + 8 * j, WHOLE ? 8 : D - c - 8 * j);
    UNROLL for (int r = 0; r < ROWS; r++) {
      __m256 ps = _mm256_broadcast_ss(p + r * stride + s);
      UNROLL for (int j = 0; j < VECS; j++) acc[r][j] = _mm256_fmadd_ps(ps, vs[j], acc[r][j]);
    }
  }
  UNROLL for (int r = 0; r < ROWS; r++)
    UNROLL for (int j = 0; j < VECS; j++) _mm256_storeu_ps(o + r * width + c + 8 * j, acc[r][j]);
}

// The sums of p v of ROWS rows over n keys: vectors of features VECS at a time, the most that both
// fit the registers beside the rows' sums and divide D / 8 (a tail of D % 8 features alone).
template <int ROWS, bool WHOLE, class T>
AVX2 void values_rows(const float* p, int64_t stride, int64_t n, const T* v, int64_t D, float* o, int64_t width) {
  constexpr int MOST = per_row(ROWS);
  int vecs = WHOLE ? MOST : 1;
  while ((D / 8) % vecs) vecs /= 2;
  auto pass = [&](auto V) {
    constexpr int VECS = decltype(V)::value;
    if constexpr (VECS <= MOST)
      for (int64_t c = 0; c < D; c += 8 * VECS) values8<ROWS, VECS, WHOLE>(p, stride, n, v, D, c, o, width);
  };
  switch (vecs) {
    case 8: pass(std::integral_constant<int, 8>{}); break;
    case 4: pass(std::integral_constant<int, 4>{}); break;
    case 2: pass(std::integral_constant<int, 2>{}); break;
    default: pass(std::integral_constant<int, 1>{}); break;
  }
}

// attend_chunk on AVX2: scores by blocks of 8 keys, then the sums of p v by blocks of VALUE_KEYS,
// rows CHUNK_ROWS at a time. q [R, VECS * 8]; writes part and acc [R, VECS * 8]. The positions a
// chunk reads are those of its own sequence's rows (attend): where one row is masked and another
// is not, the value is one the sequence wrote, finite.
template <int VECS, bool WHOLE, class T>
AVX2 void attend_chunk8(const float* q, int64_t R, int64_t D, const T* k, const T* v, const bool* visible,
                        int64_t S, int64_t s0, int64_t s1, float scale, float* scores, Partial& part, float* acc) {
  const int64_t n = s1 - s0, stride = (n + 7) / 8 * 8, width = VECS * 8;
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top[MAX_ROWS], sums[MAX_ROWS * 8];
  for (int64_t r = 0; r < R; r++) top[r] = minus_inf;
  for (int64_t b = 0; b < n; b += 8) {  // scores, 8 positions at a time; -inf where masked
    const int64_t m = std::min<int64_t>(8, n - b);
    prefetch_lines(k + (s0 + b) * D, AHEAD * D, 8 * D);
    for (int64_t r0 = 0; r0 < R; r0 += CHUNK_ROWS)
      with_rows<CHUNK_ROWS>(std::min<int64_t>(CHUNK_ROWS, R - r0), [&](auto rows) {
        dots8<decltype(rows)::value, WHOLE>(q + r0 * width, width, D, k + (s0 + b) * D, m, sums + 8 * r0);
      });
    for (int64_t r = 0; r < R; r++) {
      __m256 sc = _mm256_mul_ps(sum8x8(sums + 8 * r), _mm256_set1_ps(scale));
      sc = _mm256_blendv_ps(minus_inf, sc, visible8(visible + r * S + s0 + b, m));
      _mm256_storeu_ps(scores + r * stride + b, sc);
      top[r] = _mm256_max_ps(top[r], sc);
    }
  }
  for (int64_t r = 0; r < R; r++) {  // exponentials (0 where masked) and their sum
    float* row = scores + r * stride;
    part.max[r] = max8(top[r]);
    __m256 mx = _mm256_set1_ps(std::isinf(part.max[r]) ? 0.f : part.max[r]), total = _mm256_setzero_ps();
    for (int64_t i = 0; i < stride; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), mx));
      _mm256_storeu_ps(row + i, e);
      total = _mm256_add_ps(total, e);
    }
    part.sum[r] = sum8(total);
  }
  std::fill(acc, acc + R * width, 0.f);
  for (int64_t s = 0; s < n; s += VALUE_KEYS) {  // sums of p v
    const int64_t keys = std::min(VALUE_KEYS, n - s);
    for (int64_t i = 0; i < keys; i++) prefetch_lines(v + (s0 + s + i) * D, AHEAD * D, D);
    for (int64_t r0 = 0; r0 < R; r0 += CHUNK_ROWS)
      with_rows<CHUNK_ROWS>(std::min<int64_t>(CHUNK_ROWS, R - r0), [&](auto rows) {
        values_rows<decltype(rows)::value, WHOLE>(scores + r0 * stride + s, stride, keys, v + (s0 + s) * D, D,
                                                  acc + r0 * width, width);
      });
  }
}

template <class T>
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const int64_t* rows, const at::Tensor& mask, double scale, bool avx512) {
  int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = mask.size(-1);
  const int64_t lanes = avx512 ? 16 : 8;
  int64_t cache_S = k_cache.size(2), vecs = 1;
  while (vecs * lanes < D) vecs *= 2;  // vectors per row, a power of 2 (attend_chunk's VECS)
  const int64_t width = vecs * lanes;
  bool per_row = mask.dim() == 4;  // [B, 1, R, S]: each sequence its own positions; else [R, S]
  // Query rows in fp32, each padded with zeros to vecs vectors (the loads of the cache beyond D
  // give zeros too).
  std::vector<float> qf(B * H * R * width, 0.f);  // a few hundred floats: no ATen op for them
  bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const void* q_data = q.data_ptr();
  for (int64_t i = 0; i < B * H * R; i++)
    for (int64_t d = 0; d < D; d++)
      qf[i * width + d] = q_bf16 ? float(static_cast<const at::BFloat16*>(q_data)[i * D + d])
                                 : static_cast<const float*>(q_data)[i * D + d];
  // Positions past the last one a sequence's query rows see are never read: a cache longer than the
  // context so far (generate.py's holds the whole generation) costs nothing until it fills, nor does
  // an engine's short sequence beside a long one. Nor those before the first one they see: a sliding
  // window's layer reads its window, not the context.
  const bool* mp = mask.data_ptr<bool>();
  const int64_t spans = per_row ? B : 1;
  std::vector<int64_t> begin(spans, S), seen(spans, 0);
  int64_t longest = 0;
  for (int64_t i = 0; i < spans; i++) {
    for (int64_t r = 0; r < R; r++) {
      int64_t first, last;
      visible_span(mp + (i * R + r) * S, S, first, last);
      if (first < last) begin[i] = std::min(begin[i], first), seen[i] = std::max(seen[i], last);
    }
    begin[i] = std::min(begin[i], seen[i]);
    longest = std::max(longest, seen[i] - begin[i]);
  }
  int threads = at::get_num_threads();
  int64_t chunks = std::max<int64_t>(1, std::min((2 * threads + B * H - 1) / (B * H), longest / MIN_CHUNK));
  int64_t longest_chunk = (longest + chunks - 1) / chunks;
  std::vector<Partial> parts(B * H * chunks);
  std::vector<float> accs(B * H * chunks * R * width);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const float* qp = qf.data();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t t0, int64_t t1) {
    // Room for whole groups of rows (attend_chunk) of positions rounded up to 16.
    std::vector<float> scores((R + 15) * ((longest_chunk + 15) / 16 * 16));
    for (int64_t t = t0; t < t1; t++) {
      int64_t b = t / (H * chunks), h = t / chunks % H, c = t % chunks, i = per_row ? b : 0;
      int64_t chunk = (seen[i] - begin[i] + chunks - 1) / chunks;
      int64_t s0 = begin[i] + c * chunk, s1 = std::min(seen[i], s0 + chunk);
      int64_t row = rows ? rows[b] : b;
      const T* k = kp + (row * H + h) * cache_S * D;
      const T* v = vp + (row * H + h) * cache_S * D;
      const float* qt = qp + (b * H + h) * R * width;
      const bool* vis = mp + (per_row ? b * R * S : 0);
      float* acc = accs.data() + t * R * width;
      auto run = [&](auto V) {
        constexpr int VECS = decltype(V)::value;
        if (avx512) {
          if constexpr (VECS <= 16)
            attend_chunk<VECS>(qt, R, D, k, v, vis, S, s0, std::max(s0, s1), (float)scale, scores.data(), parts[t],
                               acc);
        } else {
          auto chunk8 = D % 8 == 0 ? attend_chunk8<VECS, true, T> : attend_chunk8<VECS, false, T>;
          chunk8(qt, R, D, k, v, vis, S, s0, std::max(s0, s1), (float)scale, scores.data(), parts[t], acc);
        }
      };
      switch (vecs) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 8: run(std::integral_constant<int, 8>{}); break;
        case 16: run(std::integral_constant<int, 16>{}); break;
        default: run(std::integral_constant<int, 32>{}); break;
      }
    }
  });
  // Merge the chunks of each head: rescale each by exp(its max - the overall max).
  auto out = at::empty({B, H, R, D}, q.options());
  bool out_bf16 = q.scalar_type() == at::kBFloat16;  // rounded from an fp32 row, no fp32 tensor to copy
  std::vector<float> row(out_bf16 ? D : 0);
  for (int64_t bh = 0; bh < B * H; bh++) {
    for (int64_t r = 0; r < R; r++) {
      float m = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t c = 0; c < chunks; c++) m = std::max(m, parts[bh * chunks + c].max[r]);
      float* o = out_bf16 ? row.data() : out.data_ptr<float>() + (bh * R + r) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < chunks; c++) {
        const Partial& p = parts[bh * chunks + c];
        if (p.max[r] == -std::numeric_limits<float>::infinity()) continue;
        float w = std::exp(p.max[r] - m);
        total += w * p.sum[r];
        const float* a = accs.data() + ((bh * chunks + c) * R + r) * width;
        for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; d++) o[d] /= total;
      if (out_bf16) std::copy(o, o + D, out.data_ptr<at::BFloat16>() + (bh * R + r) * D);
    }
  }
  return out;
}

// ---- A prompt's attention from position 0 (prefill): causal, over the prompt's own keys ----
// Flash attention's loop: per block of QBLOCK positions and key/value head, the query rows of all
// the heads that share it (GQA) meet the key blocks up to the diagonal and no further, keeping a
// running maximum, sum of exponentials and weighted sum of values per row. Blocks past the
// diagonal are never computed (SDPA's CPU kernel computes a prompt of up to 512 keys whole, half of
// it masked). Both products are register tiles of fp32 FMAs: scores against the keys transposed
// once per head ([D, T]), sums of p v against the value rows as they are.
constexpr int64_t QBLOCK = 32, KBLOCK = 64;  // KBLOCK: the 4 vectors of a score tile's row
constexpr int TILE_ROWS = 6;                 // 6 rows x 4 vectors = 24 accumulators of the 32 registers

// s[r, 0:64] = qs[r] . kt[:, 0:64] for ROWS query rows qs [ROWS, D] (scaled); kt [D, ld].
template <int ROWS>
AVX512 void score_tile(const float* qs, int64_t D, const float* kt, int64_t ld, float* s) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    __m512 kv[4];
    for (int j = 0; j < 4; j++) kv[j] = _mm512_loadu_ps(kt + d * ld + 16 * j);
    for (int r = 0; r < ROWS; r++) {
      __m512 x = _mm512_set1_ps(qs[r * D + d]);
      for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(x, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(s + r * KBLOCK + 16 * j, acc[r][j]);
}

// o[r, 0:16 VECS] = alpha[r] o[r] + sum_j p[r, j] v[j, 0:16 VECS], j < n, for ROWS rows (row
// strides: o D, p KBLOCK, v ldv).
template <int ROWS, int VECS>
AVX512 void value_tile(const float* p, int64_t n, const float* v, int64_t ldv, const float* alpha, float* o,
                       int64_t D) {
  __m512 acc[ROWS][VECS];
  for (int r = 0; r < ROWS; r++)
    for (int j = 0; j < VECS; j++)
      acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * j), _mm512_set1_ps(alpha[r]));
  for (int64_t i = 0; i < n; i++) {
    __m512 vv[VECS];
    for (int j = 0; j < VECS; j++) vv[j] = _mm512_loadu_ps(v + i * ldv + 16 * j);
    for (int r = 0; r < ROWS; r++) {
      __m512 x = _mm512_set1_ps(p[r * KBLOCK + i]);
      for (int j = 0; j < VECS; j++) acc[r][j] = _mm512_fmadd_ps(x, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int j = 0; j < VECS; j++) _mm512_storeu_ps(o + r * D + 16 * j, acc[r][j]);
}

template <int R>
AVX512 void value_rows(const float* p, int64_t n, const float* v, int64_t ldv, const float* alpha, float* o,
                       int64_t D) {
  int64_t c = 0;  // 4 vectors of features at a time, then the rest (D is a multiple of 16)
  for (; c + 64 <= D; c += 64) value_tile<R, 4>(p, n, v + c, ldv, alpha, o + c, D);
  switch ((D - c) / 16) {
    case 1: value_tile<R, 1>(p, n, v + c, ldv, alpha, o + c, D); break;
    case 2: value_tile<R, 2>(p, n, v + c, ldv, alpha, o + c, D); break;
    case 3: value_tile<R, 3>(p, n, v + c, ldv, alpha, o + c, D); break;
  }
}

// Scratch of one thread: rows [R, D] of queries (scaled), their sums of p v, scores [R, KBLOCK],
// running maxima, sums and rescalings [R], and a block of values in fp32 [KBLOCK, D].
struct BlockScratch {
  std::vector<float> q, o, s, top, sum, alpha, v;
  BlockScratch(int64_t rows, int64_t D)
      : q(rows * D), o(rows * D), s(rows * KBLOCK), top(rows), sum(rows), alpha(rows), v(KBLOCK * D) {}
};

// A prompt's block (attend_prompt): row r is head r / m of the group, position t0 + r % m, and sees
// keys [0, t0 + r % m]; q [.., H, T, D] and y [B, T, H * D] of one sequence and group.
template <class E>
struct CausalRows {
  const E* q;
  int64_t q_head, q_pos;  // q's strides
  E* y;
  int64_t y_pos, D, t0, m;
  const E* query(int64_t r) const { return q + r / m * q_head + (t0 + r % m) * q_pos; }
  E* out(int64_t r) const { return y + (t0 + r % m) * y_pos + r / m * D; }
  int64_t begin() const { return 0; }
  int64_t end() const { return t0 + m; }
  uint64_t visible(int64_t r, int64_t n0, int64_t n) const {
    return first64(std::min(n, t0 + r % m - n0 + 1));
  }
};

// A block of decode_attention's query rows past MAX_ROWS (a prompt's chunk at any position, the
// engine's ragged prompts): rows contiguous in q and y, each with its mask row of S positions;
// [first, last) bounds every row's visible positions.
template <class E>
struct MaskedRows {
  const E* q;
  E* y;
  const bool* mask;
  int64_t D, S, first, last;
  const E* query(int64_t r) const { return q + r * D; }
  E* out(int64_t r) const { return y + r * D; }
  int64_t begin() const { return first; }
  int64_t end() const { return last; }
  uint64_t visible(int64_t r, int64_t n0, int64_t n) const {
    return true_bits(mask + r * S + n0, n);
  }
};

// attend_block's start, either instruction set: the rows' queries scaled, in fp32; their sums of
// p v, maxima and sums of exponentials reset.
template <class Rows>
void start_block(const Rows& rows, int64_t R, int64_t D, float scale, BlockScratch& w) {
  for (int64_t r = 0; r < R; r++) {
    const auto* src = rows.query(r);
    for (int64_t d = 0; d < D; d++) w.q[r * D + d] = static_cast<float>(src[d]) * scale;
  }
  std::fill(w.o.begin(), w.o.begin() + R * D, 0.f);
  std::fill(w.top.begin(), w.top.begin() + R, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + R, 0.f);
}

// And its end: each row's sum of p v over its sum of exponentials, in the output's dtype.
template <class Rows>
void finish_block(const Rows& rows, int64_t R, int64_t D, const BlockScratch& w) {
  for (int64_t r = 0; r < R; r++) {
    auto* dst = rows.out(r);
    float inv = 1.f / w.sum[r];
    for (int64_t d = 0; d < D; d++) dst[d] = static_cast<std::remove_pointer_t<decltype(dst)>>(w.o[r * D + d] * inv);
  }
}

// R query rows (Rows: where each is, which keys it sees) against the keys of one sequence and
// key/value head: kt [D, ld] transposed keys in fp32 (ld covers the rows' keys rounded up to
// KBLOCK), v [keys, D] value rows (row stride ldv). Writes each row's output.
template <class C, class Rows>
AVX512 void attend_block(const Rows& rows, int64_t R, int64_t D, const float* kt, int64_t ld, const C* v,
                         int64_t ldv, float scale, BlockScratch& w) {
  start_block(rows, R, D, scale, w);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t n0 = rows.begin() / KBLOCK * KBLOCK; n0 < rows.end(); n0 += KBLOCK) {
    const int64_t n = std::min(KBLOCK, rows.end() - n0);  // keys any row of the block sees
    for (int64_t r = 0; r < R; r += TILE_ROWS)
      with_rows<TILE_ROWS>(std::min<int64_t>(TILE_ROWS, R - r), [&](auto tile) {
        score_tile<decltype(tile)::value>(w.q.data() + r * D, D, kt + n0, ld, w.s.data() + r * KBLOCK);
      });
    for (int64_t r = 0; r < R; r++) {  // -inf where row r does not see the key
      float* row = w.s.data() + r * KBLOCK;
      uint64_t seen = rows.visible(r, n0, n);
      __m512 sc[4], mx = _mm512_set1_ps(minus_inf);
      for (int j = 0; j < 4; j++) sc[j] = _mm512_mask_blend_ps(__mmask16(seen >> (16 * j)), mx, _mm512_loadu_ps(row + 16 * j));
      float block_top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(sc[0], sc[1]), _mm512_max_ps(sc[2], sc[3])));
      float new_top = std::max(w.top[r], block_top);
      // Nothing seen yet: no exponentials, nothing to rescale (0 at the first seen block: top -inf).
      w.alpha[r] = new_top == minus_inf ? 1.f : std::exp(w.top[r] - new_top);
      __m512 total = _mm512_setzero_ps(), nt = _mm512_set1_ps(new_top == minus_inf ? 0.f : new_top);
      for (int j = 0; j < 4; j++) {
        __m512 e = exp16(_mm512_sub_ps(sc[j], nt));
        _mm512_storeu_ps(row + 16 * j, e);
        total = _mm512_add_ps(total, e);
      }
      w.sum[r] = w.sum[r] * w.alpha[r] + _mm512_reduce_add_ps(total);
      w.top[r] = new_top;
    }
    const C* vsrc = v + n0 * ldv;
    const float* vb;
    int64_t ldf;
    if constexpr (std::is_same_v<C, float>) {
      vb = vsrc, ldf = ldv;
    } else {
      for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(w.v.data() + i * D + d, load16(vsrc + i * ldv + d, 16));
      vb = w.v.data(), ldf = D;
    }
    for (int64_t r = 0; r < R; r += TILE_ROWS)
      with_rows<TILE_ROWS>(std::min<int64_t>(TILE_ROWS, R - r), [&](auto tile) {
        value_rows<decltype(tile)::value>(w.s.data() + r * KBLOCK, n, vb, ldf, w.alpha.data() + r, w.o.data() + r * D,
                                          D);
      });
  }
  finish_block(rows, R, D, w);
}

// ---- The same on AVX2 (8 lanes, 16 registers): tiles of up to 6 rows x 2 vectors, 12 sums and
// the 2 vectors read and the row's broadcast value in the other 4 registers ----

// s[r, 0:16] = qs[r] . kt[:, 0:16] for ROWS query rows qs [ROWS, D] (scaled); kt [D, ld].
template <int ROWS>
AVX2 void score_tile8(const float* qs, int64_t D, const float* kt, int64_t ld, float* s) {
  __m256 acc[ROWS][2];
  UNROLL for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    __m256 k0 = _mm256_loadu_ps(kt + d * ld), k1 = _mm256_loadu_ps(kt + d * ld + 8);
    UNROLL for (int r = 0; r < ROWS; r++) {
      __m256 x = _mm256_broadcast_ss(qs + r * D + d);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
  UNROLL for (int r = 0; r < ROWS; r++) {
    _mm256_storeu_ps(s + r * KBLOCK, acc[r][0]);
    _mm256_storeu_ps(s + r * KBLOCK + 8, acc[r][1]);
  }
}

// o[r, 0:16] = alpha[r] o[r] + sum_j p[r, j] v[j, 0:16], j < n, for ROWS rows (row strides: o D,
// p KBLOCK, v ldv).
template <int ROWS>
AVX2 void value_tile8(const float* p, int64_t n, const float* v, int64_t ldv, const float* alpha, float* o,
                      int64_t D) {
  __m256 acc[ROWS][2];
  UNROLL for (int r = 0; r < ROWS; r++) {
    __m256 a = _mm256_broadcast_ss(alpha + r);
    acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D), a);
    acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + 8), a);
  }
  for (int64_t i = 0; i < n; i++) {
    __m256 v0 = _mm256_loadu_ps(v + i * ldv), v1 = _mm256_loadu_ps(v + i * ldv + 8);
    UNROLL for (int r = 0; r < ROWS; r++) {
      __m256 x = _mm256_broadcast_ss(p + r * KBLOCK + i);
      acc[r][0] = _mm256_fmadd_ps(x, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, v1, acc[r][1]);
    }
  }
  UNROLL for (int r = 0; r < ROWS; r++) {
    _mm256_storeu_ps(o + r * D, acc[r][0]);
    _mm256_storeu_ps(o + r * D + 8, acc[r][1]);
  }
}

// attend_block on AVX2; scores and values only for the n keys of a block that some row sees.
template <class C, class Rows>
AVX2 void attend_block8(const Rows& rows, int64_t R, int64_t D, const float* kt, int64_t ld, const C* v,
                        int64_t ldv, float scale, BlockScratch& w) {
  start_block(rows, R, D, scale, w);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t n0 = rows.begin() / KBLOCK * KBLOCK; n0 < rows.end(); n0 += KBLOCK) {
    const int64_t n = std::min(KBLOCK, rows.end() - n0), vecs = (n + 7) / 8;
    for (int64_t r = 0; r < R; r += TILE_ROWS)
      with_rows<TILE_ROWS>(std::min<int64_t>(TILE_ROWS, R - r), [&](auto tile) {
        for (int64_t c = 0; c < n; c += 16)
          score_tile8<decltype(tile)::value>(w.q.data() + r * D, D, kt + n0 + c, ld, w.s.data() + r * KBLOCK + c);
      });
    for (int64_t r = 0; r < R; r++) {  // -inf where row r does not see the key (lanes past n too)
      float* row = w.s.data() + r * KBLOCK;
      uint64_t seen = rows.visible(r, n0, n);
      __m256 sc[KBLOCK / 8], mx = _mm256_set1_ps(minus_inf), top = mx;
      for (int64_t j = 0; j < vecs; j++) {
        sc[j] = _mm256_blendv_ps(mx, _mm256_loadu_ps(row + 8 * j), lanes8(seen, j));
        top = _mm256_max_ps(top, sc[j]);
      }
      float new_top = std::max(w.top[r], max8(top));
      w.alpha[r] = new_top == minus_inf ? 1.f : std::exp(w.top[r] - new_top);
      __m256 total = _mm256_setzero_ps(), nt = _mm256_set1_ps(new_top == minus_inf ? 0.f : new_top);
      for (int64_t j = 0; j < vecs; j++) {
        __m256 e = exp8(_mm256_sub_ps(sc[j], nt));
        _mm256_storeu_ps(row + 8 * j, e);
        total = _mm256_add_ps(total, e);
      }
      w.sum[r] = w.sum[r] * w.alpha[r] + sum8(total);
      w.top[r] = new_top;
    }
    const C* vsrc = v + n0 * ldv;
    const float* vb;
    int64_t ldf;
    if constexpr (std::is_same_v<C, float>) {
      vb = vsrc, ldf = ldv;
    } else {
      for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(w.v.data() + i * D + d, load8(vsrc + i * ldv + d, 8));
      vb = w.v.data(), ldf = D;
    }
    for (int64_t r = 0; r < R; r += TILE_ROWS)
      with_rows<TILE_ROWS>(std::min<int64_t>(TILE_ROWS, R - r), [&](auto tile) {
        for (int64_t c = 0; c < D; c += 16)
          value_tile8<decltype(tile)::value>(w.s.data() + r * KBLOCK, n, vb + c, ldf, w.alpha.data() + r,
                                             w.o.data() + r * D + c, D);
      });
  }
  finish_block(rows, R, D, w);
}

// The z-th block of a head's `blocks` in the order first, last, second, second to last...: a
// thread's contiguous share of the work items costs about the same as another's, where a later
// block of a causal prompt meets more keys.
inline int64_t zigzag(int64_t z, int64_t blocks) { return z % 2 == 0 ? z / 2 : blocks - 1 - z / 2; }

// The row stride of n keys transposed: whole blocks of keys and one vector more, so that rows
// are no power of two apart. At 1024 keys (4 KB) a tile's 64 rows fell into one set of L1's, which
// holds 8: every step of the tile read its keys from L2.
inline int64_t key_stride(int64_t n) { return (n + KBLOCK - 1) / KBLOCK * KBLOCK + 16; }

// keys [0, n) of k [n, D] (row stride ld_k) -> kt [D, ld] fp32, zeros past n.
template <class C>
void transpose_keys(const C* k, int64_t ld_k, int64_t n, int64_t D, int64_t ld, float* kt) {
  for (int64_t t = 0; t < ld; t++)
    for (int64_t d = 0; d < D; d++) kt[d * ld + t] = t < n ? static_cast<float>(k[t * ld_k + d]) : 0.f;
}

// y [B, T, H * D] = causal attention of q [B, H, T, D] over k, v [B, KV, T, D].
template <class E>
void attend_prompt(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale, bool avx512,
                   at::Tensor& y) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1), rep = H / KV;
  const int64_t Tp = key_stride(T), blocks = (T + QBLOCK - 1) / QBLOCK;
  const E* kp = k.data_ptr<E>();
  // Keys transposed per head, fp32, zero past T (masked scores: zeros keep them finite).
  std::vector<float> kt(B * KV * D * Tp);
  at::parallel_for(0, B * KV, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t bh = h0; bh < h1; bh++)
      transpose_keys(kp + bh / KV * k.stride(0) + bh % KV * k.stride(1), k.stride(2), T, D, Tp, kt.data() + bh * D * Tp);
  });
  // Work items: (sequence, key/value head, block of positions), the blocks in zigzag order.
  at::parallel_for(0, B * KV * blocks, 1, [&](int64_t i0, int64_t i1) {
    BlockScratch w(rep * QBLOCK, D);
    for (int64_t item = i0; item < i1; item++) {
      int64_t bh = item / blocks, z = item % blocks, b = bh / KV, g = bh % KV;
      int64_t t0 = zigzag(z, blocks) * QBLOCK, m = std::min(QBLOCK, T - t0);
      CausalRows<E> rows{q.data_ptr<E>() + b * q.stride(0) + g * rep * q.stride(1), q.stride(1), q.stride(2),
                         y.data_ptr<E>() + b * T * H * D + g * rep * D, H * D, D, t0, m};
      const E* vh = v.data_ptr<E>() + b * v.stride(0) + g * v.stride(1);
      if (avx512)
        attend_block(rows, rep * m, D, kt.data() + bh * D * Tp, Tp, vh, v.stride(2), scale, w);
      else
        attend_block8(rows, rep * m, D, kt.data() + bh * D * Tp, Tp, vh, v.stride(2), scale, w);
    }
  });
}

// decode_attention for more than MAX_ROWS query rows per head (a prompt's chunk past position 0,
// the engine's ragged prompts): blocks of QBLOCK rows in attend_block's tiles, each block reading
// the positions from the first any of its rows sees to the last (from the mask rows).
template <class E, class C>
at::Tensor attend_many(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const int64_t* rows, const at::Tensor& mask, float scale, bool avx512) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = mask.size(-1);
  const int64_t cache_S = k_cache.size(2), Sp = key_stride(S), blocks = (R + QBLOCK - 1) / QBLOCK;
  const bool per_row = mask.dim() == 4;
  const bool* mp = mask.data_ptr<bool>();
  auto out = at::empty({B, H, R, D}, q.options());
  std::vector<float> kt(B * H * D * Sp);
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t bh = h0; bh < h1; bh++) {
      int64_t row = rows ? rows[bh / H] : bh / H;
      transpose_keys(k_cache.data_ptr<C>() + (row * H + bh % H) * cache_S * D, D, S, D, Sp, kt.data() + bh * D * Sp);
    }
  });
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t i0, int64_t i1) {
    BlockScratch w(QBLOCK, D);
    for (int64_t item = i0; item < i1; item++) {
      int64_t bh = item / blocks, z = item % blocks, b = bh / H, h = bh % H;
      int64_t r0 = zigzag(z, blocks) * QBLOCK, m = std::min(QBLOCK, R - r0);
      const bool* vis = mp + (per_row ? b * R * S : 0) + r0 * S;
      int64_t first = S, last = 0;  // the positions any row of the block sees
      for (int64_t r = 0; r < m; r++) {
        int64_t f, l;
        visible_span(vis + r * S, S, f, l);
        if (f < l) first = std::min(first, f), last = std::max(last, l);
      }
      MaskedRows<E> block_rows{q.data_ptr<E>() + (bh * R + r0) * D, out.data_ptr<E>() + (bh * R + r0) * D, vis, D, S,
                               std::min(first, last), last};
      int64_t row = rows ? rows[b] : b;
      const C* vh = v_cache.data_ptr<C>() + (row * H + h) * cache_S * D;
      if (avx512)
        attend_block(block_rows, m, D, kt.data() + bh * D * Sp, Sp, vh, D, scale, w);
      else
        attend_block8(block_rows, m, D, kt.data() + bh * D * Sp, Sp, vh, D, scale, w);
    }
  });
  return out;
}

}  // namespace

bool attention_supported() {  // AVX-512's code (else AVX2's): kernels.py and rowwise.cpp ask
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

// q [B, H, R, D]: R query rows per key/value head (past MAX_ROWS: attend_many, D a multiple of 16);
// k_cache, v_cache [rows, H, S', D]; rows [B]: the cache row of each sequence (None: 0..B-1); mask
// [R, S] or [B, 1, R, S], true where a query row sees a position (S <= S'). Returns softmax(q k^T * scale, masked) v,
// [B, H, R, D] in q's dtype. isa (kernels.ISA_CODES, as the products'): 0 AVX2, else AVX-512 where the CPU has it.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& rows, const at::Tensor& mask, double scale,
                            int64_t isa) {
  check_avx2();
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(1) == q.size(1) && k_cache.size(3) == q.size(3),
              "decode_attention: q [B, H, R, D] and caches [rows, H, S, D]");
  auto is_f32_or_bf16 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && is_f32_or_bf16(k_cache) && is_f32_or_bf16(q),
              "decode_attention: q float32 or bfloat16, both caches in one of those");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches");
  TORCH_CHECK(q.size(3) <= 256 && (q.size(2) <= MAX_ROWS || q.size(3) % 16 == 0),
              "decode_attention: at most 256 features, a multiple of 16 for more than ", MAX_ROWS, " query rows per head");
  int64_t B = q.size(0), R = q.size(2), S = mask.size(-1);
  TORCH_CHECK(mask.scalar_type() == at::kBool && S <= k_cache.size(2) &&
                  (mask.dim() == 2 ? mask.size(0) == R : mask.dim() == 4 && mask.size(0) == B && mask.size(2) == R),
              "decode_attention: a bool mask [R, S] or [B, 1, R, S], S within the cache");
  at::Tensor row_ids;
  if (rows.has_value()) {
    row_ids = rows->to(at::kLong).contiguous();
    TORCH_CHECK(row_ids.numel() == B, "decode_attention: one cache row per sequence");
    const int64_t* ip = row_ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++)
      TORCH_CHECK(ip[b] >= 0 && ip[b] < k_cache.size(0), "decode_attention: cache row ", ip[b], " out of range");
  } else {
    TORCH_CHECK(B <= k_cache.size(0), "decode_attention: more sequences than cache rows");
  }
  auto m = mask.contiguous();
  auto qc = q.contiguous();
  const int64_t* rp = rows.has_value() ? row_ids.data_ptr<int64_t>() : nullptr;
  // The query rows are read into fp32 whatever their dtype; the caches' dtype picks the loads.
  bool cache_f32 = k_cache.scalar_type() == at::kFloat;
  const bool avx512 = wide(isa);
  if (R > MAX_ROWS) {
    if (qc.scalar_type() == at::kFloat)
      return cache_f32 ? attend_many<float, float>(qc, k_cache, v_cache, rp, m, scale, avx512)
                       : attend_many<float, at::BFloat16>(qc, k_cache, v_cache, rp, m, scale, avx512);
    return cache_f32 ? attend_many<at::BFloat16, float>(qc, k_cache, v_cache, rp, m, scale, avx512)
                     : attend_many<at::BFloat16, at::BFloat16>(qc, k_cache, v_cache, rp, m, scale, avx512);
  }
  if (cache_f32) return attend<float>(qc, k_cache, v_cache, rp, m, scale, avx512);
  return attend<at::BFloat16>(qc, k_cache, v_cache, rp, m, scale, avx512);
}

// q [B, H, T, D], k, v [B, KV, T, D] (any strides, features contiguous; H a multiple of KV), the
// whole sequences so far from position 0: causal attention, softmax(q k^T * scale) v, returned as
// [B, T, H * D] in q's dtype (the layout the output projection reads). isa (kernels.ISA_CODES, as
// the products'): 0 AVX2, else AVX-512 where the CPU has it.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t isa) {
  check_avx2();
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "prompt_attention: q [B, H, T, D], k and v [B, KV, T, D], H a multiple of KV");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "prompt_attention: q, k, v all float32 or all bfloat16");
  TORCH_CHECK(q.size(3) % 16 == 0 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "prompt_attention: a multiple of 16 features, contiguous");
  auto y = at::empty({q.size(0), q.size(2), q.size(1) * q.size(3)}, q.options());
  if (q.numel() == 0) return y;
  const bool avx512 = wide(isa);
  if (q.scalar_type() == at::kFloat)
    attend_prompt<float>(q, k, v, (float)scale, avx512, y);
  else
    attend_prompt<at::BFloat16>(q, k, v, (float)scale, avx512, y);
  return y;
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  // flexible_layout: inductor passes its buffers as they are (the op copies what must be contiguous).
  // Under its default for custom ops (exact strides) it recomputed the step's mask for every layer.
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? rows, Tensor mask, float scale, int isa) "
        "-> Tensor",
        {at::Tag::flexible_layout});
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale, int isa) -> Tensor");
}
TORCH_LIBRARY_IMPL(brisk, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prompt_attention", &prompt_attention);
}
