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

// Query rows q [R, VECS * 16] (fp32, zero-padded) against positions [s0, s1) of one cache row's head
// k, v [S, D]; visible[r * S + s] says which positions row r sees. Writes part and acc [R, VECS * 16].
// VECS vectors of 16 features are a compile-time count, so that a row's sums stay in registers.
template <int VECS, class T>
AVX512 void attend_chunk(const float* q, int64_t R, int64_t D, const T* k, const T* v, const bool* visible,
                         int64_t S, int64_t s0, int64_t s1, float scale, float* scores, Partial& part, float* acc) {
  int64_t n = s1 - s0;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < R; r++) {  // scores, four positions at a time (independent sums)
    __m512 qr[VECS];
    for (int j = 0; j < VECS; j++) qr[j] = _mm512_loadu_ps(q + (r * VECS + j) * 16);
    const bool* vis = visible + r * S;
    float* row = scores + r * n, top = minus_inf;
    int64_t s = s0;
    for (; s + 4 <= s1; s += 4) {
      __m512 dot[4];
      for (int i = 0; i < 4; i++) {
        dot[i] = _mm512_mul_ps(qr[0], load16(k + (s + i) * D, D));
        for (int j = 1; j < VECS; j++) dot[i] = _mm512_fmadd_ps(qr[j], load16(k + (s + i) * D + 16 * j, D - 16 * j), dot[i]);
      }
      for (int i = 0; i < 4; i++) {
        float score = vis[s + i] ? _mm512_reduce_add_ps(dot[i]) * scale : minus_inf;
        row[s + i - s0] = score;
        top = std::max(top, score);
      }
    }
    for (; s < s1; s++) {
      __m512 dot = _mm512_mul_ps(qr[0], load16(k + s * D, D));
      for (int j = 1; j < VECS; j++) dot = _mm512_fmadd_ps(qr[j], load16(k + s * D + 16 * j, D - 16 * j), dot);
      float score = vis[s] ? _mm512_reduce_add_ps(dot) * scale : minus_inf;
      row[s - s0] = score;
      top = std::max(top, score);
    }
    part.max[r] = top;
  }
  for (int64_t r = 0; r < R; r++) {  // exponentials (0 where masked) and their sum
    float* row = scores + r * n;
    __m512 m = _mm512_set1_ps(part.max[r] == minus_inf ? 0.f : part.max[r]), total = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), m));
      _mm512_storeu_ps(row + i, e);
      total = _mm512_add_ps(total, e);
    }
    float sum = _mm512_reduce_add_ps(total);
    for (; i < n; i++) sum += row[i] = row[i] == minus_inf ? 0.f : std::exp(row[i] - part.max[r]);
    part.sum[r] = sum;
  }
  for (int64_t r = 0; r < R; r++) {  // sum of p v per row, in registers
    __m512 a[VECS];
    for (int j = 0; j < VECS; j++) a[j] = _mm512_setzero_ps();
    const float* p = scores + r * n;
    for (int64_t s = s0; s < s1; s++) {
      if (p[s - s0] == 0.f) continue;  // masked (or negligible)
      __m512 ps = _mm512_set1_ps(p[s - s0]);
      for (int j = 0; j < VECS; j++) a[j] = _mm512_fmadd_ps(ps, load16(v + s * D + 16 * j, D - 16 * j), a[j]);
    }
    for (int j = 0; j < VECS; j++) _mm512_storeu_ps(acc + (r * VECS + j) * 16, a[j]);
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
  // so far (generate.py's holds the whole generation) costs nothing until it fills.
  const bool* mp = mask.data_ptr<bool>();
  int64_t seen = 0;
  for (int64_t i = 0; i < (per_row ? B : 1) * R; i++) {
    int64_t last = S;
    while (last > seen && !mp[i * S + last - 1]) last--;
    seen = std::max(seen, last);
  }
  int threads = at::get_num_threads();
  int64_t chunks = std::max<int64_t>(1, std::min((2 * threads + B * H - 1) / (B * H), seen / MIN_CHUNK));
  int64_t chunk = (seen + chunks - 1) / chunks;
  std::vector<Partial> parts(B * H * chunks);
  std::vector<float> accs(B * H * chunks * R * vecs * 16);
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const float* qp = qf.data();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(R * chunk);
    for (int64_t t = t0; t < t1; t++) {
      int64_t b = t / (H * chunks), h = t / chunks % H, c = t % chunks;
      int64_t s0 = c * chunk, s1 = std::min(seen, s0 + chunk);
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
