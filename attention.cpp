// Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
// Attention of a decode step: a few query rows per sequence (the query heads that share a key/value
// head, times the step's tokens) against that sequence's KV cache row, read in place.
//
// The time of a decode step at a long context goes here: every step reads the whole cache. Each
// key and value vector is read once, for all query rows of its head, and the positions are split
// between the threads in chunks (flash-decoding): a chunk keeps its own running maximum, sum of
// exponentials and weighted sum of values, and the chunks of a head are merged at the end, so
// that even one sequence with three key/value heads keeps both cores busy.
// Built with kernels.cpp into one extension (kernels.py); AVX-512 only (kernels.py uses it where
// kernels.best_isa() says so; elsewhere model.py's own attention runs).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace {

constexpr int64_t MAX_ROWS = 16;  // query rows per key/value head (heads per group x tokens)
constexpr int64_t MIN_CHUNK = 64;  // positions: fewer make the merge cost more than it saves

// 16 values of a cache vector as fp32, of which the first d are read (d <= 0: none; zeros past d).
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

struct Partial {  // one chunk of positions, per query row: max score, sum of exponentials, sum p v
  float max[MAX_ROWS], sum[MAX_ROWS];
};

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

template <class T>
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const int64_t* rows, const torch::Tensor& mask, double scale) {
  int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = mask.size(-1);
  int64_t cache_S = k_cache.size(2), vecs = 1;
  while (vecs * 16 < D) vecs *= 2;  // 16-feature vectors per row, a power of 2 (attend_chunk's VECS)
  bool per_row = mask.dim() == 4;  // [B, 1, R, S]: each sequence its own positions; else [R, S]
  // Query rows in fp32, each padded with zeros to vecs vectors (a masked load of the cache beyond D
  // gives zeros too).
  std::vector<float> qf(B * H * R * vecs * 16, 0.f);  // a few hundred floats: no ATen op for them
  bool q_bf16 = q.scalar_type() == torch::kBFloat16;
  const void* q_data = q.data_ptr();
  for (int64_t i = 0; i < B * H * R; i++)
    for (int64_t d = 0; d < D; d++)
      qf[i * vecs * 16 + d] = q_bf16 ? float(static_cast<const at::BFloat16*>(q_data)[i * D + d])
                                     : static_cast<const float*>(q_data)[i * D + d];
  // Positions past the last one a query row sees are never read: a cache longer than the context
  // so far (generate.py's holds the whole generation) costs nothing until it fills. Nor those
  // before the first one any row sees: a sliding window's layer reads its window, not the context.
  const bool* mp = mask.data_ptr<bool>();
  int64_t seen = 0, rows_total = (per_row ? B : 1) * R;
  for (int64_t i = 0; i < rows_total; i++) {
    int64_t last = S;
    while (last > seen && !mp[i * S + last - 1]) last--;
    seen = std::max(seen, last);
  }
  int64_t begin = seen;
  for (int64_t i = 0; i < rows_total; i++) {
    int64_t first = 0;
    while (first < begin && !mp[i * S + first]) first++;
    begin = std::min(begin, first);
  }
  int threads = at::get_num_threads();
  int64_t span = seen - begin;
  int64_t chunks = std::max<int64_t>(1, std::min((2 * threads + B * H - 1) / (B * H), span / MIN_CHUNK));
  int64_t chunk = (span + chunks - 1) / chunks;
  std::vector<Partial> parts(B * H * chunks);
  std::vector<float> accs(B * H * chunks * R * vecs * 16);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const float* qp = qf.data();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t t0, int64_t t1) {
    // Room for whole groups of rows (attend_chunk) of positions rounded up to 16.
    std::vector<float> scores((R + 15) * ((chunk + 15) / 16 * 16));
    for (int64_t t = t0; t < t1; t++) {
      int64_t b = t / (H * chunks), h = t / chunks % H, c = t % chunks;
      int64_t s0 = begin + c * chunk, s1 = std::min(seen, s0 + chunk);
      int64_t row = rows ? rows[b] : b;
      const T* k = kp + (row * H + h) * cache_S * D;
      const T* v = vp + (row * H + h) * cache_S * D;
      const float* qt = qp + (b * H + h) * R * vecs * 16;
      const bool* vis = mp + (per_row ? b * R * S : 0);
      float* acc = accs.data() + t * R * vecs * 16;
      auto run = [&](auto V) {
        attend_chunk<decltype(V)::value>(qt, R, D, k, v, vis, S, s0, std::max(s0, s1), (float)scale, scores.data(),
                                         parts[t], acc);
      };
      switch (vecs) {
        case 1: run(std::integral_constant<int, 1>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 8: run(std::integral_constant<int, 8>{}); break;
        default: run(std::integral_constant<int, 16>{}); break;
      }
    }
  });
  // Merge the chunks of each head: rescale each by exp(its max - the overall max).
  auto out = torch::empty({B, H, R, D}, q.options());
  auto out_f = q.scalar_type() == torch::kFloat ? out : torch::empty({B, H, R, D}, q.options().dtype(torch::kFloat));
  float* op = out_f.data_ptr<float>();
  for (int64_t bh = 0; bh < B * H; bh++) {
    for (int64_t r = 0; r < R; r++) {
      float m = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t c = 0; c < chunks; c++) m = std::max(m, parts[bh * chunks + c].max[r]);
      float* o = op + (bh * R + r) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t c = 0; c < chunks; c++) {
        const Partial& p = parts[bh * chunks + c];
        if (p.max[r] == -std::numeric_limits<float>::infinity()) continue;
        float w = std::exp(p.max[r] - m);
        total += w * p.sum[r];
        const float* a = accs.data() + ((bh * chunks + c) * R + r) * vecs * 16;
        for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < D; d++) o[d] /= total;
    }
  }
  if (out_f.data_ptr() != out.data_ptr()) out.copy_(out_f);
  return out;
}

}  // namespace

bool attention_supported() {  // kernels.py asks before attaching the kernel
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

// q [B, H, R, D]: R query rows per key/value head; k_cache, v_cache [rows, H, S', D]; rows [B]: the
// cache row of each sequence (None: 0..B-1); mask [R, S] or [B, 1, R, S], true where a query row
// sees a position (S <= S'). Returns softmax(q k^T * scale, masked) v, [B, H, R, D] in q's dtype.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const c10::optional<torch::Tensor>& rows, const torch::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(1) == q.size(1) && k_cache.size(3) == q.size(3),
              "decode_attention: q [B, H, R, D] and caches [rows, H, S, D]");
  auto is_f32_or_bf16 = [](const torch::Tensor& t) {
    return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
  };
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && is_f32_or_bf16(k_cache) && is_f32_or_bf16(q),
              "decode_attention: q float32 or bfloat16, both caches in one of those");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches");
  TORCH_CHECK(q.size(2) <= MAX_ROWS && q.size(3) <= 256, "decode_attention: at most ", MAX_ROWS,
              " query rows per head and 256 features");
  int64_t B = q.size(0), R = q.size(2), S = mask.size(-1);
  TORCH_CHECK(mask.scalar_type() == torch::kBool && S <= k_cache.size(2) &&
                  (mask.dim() == 2 ? mask.size(0) == R : mask.dim() == 4 && mask.size(0) == B && mask.size(2) == R),
              "decode_attention: a bool mask [R, S] or [B, 1, R, S], S within the cache");
  torch::Tensor row_ids;
  if (rows.has_value()) {
    row_ids = rows->to(torch::kLong).contiguous();
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
  if (k_cache.scalar_type() == torch::kFloat) return attend<float>(qc, k_cache, v_cache, rp, m, scale);
  return attend<at::BFloat16>(qc, k_cache, v_cache, rp, m, scale);
}

TORCH_LIBRARY_FRAGMENT(brisk, m) {
  // flexible_layout: inductor passes its buffers as they are (the op copies what must be contiguous).
  // Under its default for custom ops (exact strides) it recomputed the step's mask for every layer.
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? rows, Tensor mask, float scale) -> Tensor",
        {at::Tag::flexible_layout});
}
TORCH_LIBRARY_IMPL(brisk, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
