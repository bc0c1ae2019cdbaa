// Decode attention on the CPU over the paged KV pool, read in place (AVX-512).
//
// One query token per request. For each request and KV head, the scores of the group's query
// heads against every key of the request (its slots from the req-to-token table), a softmax in
// fp32, and the weighted sum of the values: each K and V row is read once, from its slot, with
// no gathered copy. Keys outside a sliding window are skipped; a logit cap soft-caps the
// scaled scores to cap * tanh(score / cap).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// e^x for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error below 2e-7 there), times 2^n. Below -60 the result is 0: the softmax's terms
// are e^(s - max), so a term under e^-60 changes no fp32 sum, and a weight that small, divided
// by the sum, could be a denormal, whose arithmetic is slow.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-60.f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(~under, p, n);
}

template <typename T>
inline __m512 load16(const T* p, __mmask16 m);

template <>
inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Slots are scattered over the pool: the rows kAhead tokens on are requested while this one
// is computed.
constexpr int64_t kAhead = 8;

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

template <typename T>
void decode_impl(
    const float* q, const T* kbuf, const T* vbuf, const int64_t* table, int64_t table_stride,
    const int64_t* rows, const int64_t* seq_lens, int64_t bs, int64_t heads, int64_t kv_heads,
    int64_t dim, double scale, int64_t window, double cap, float* out) {
  const int64_t group = heads / kv_heads, chunks = (dim + 15) / 16;
  at::parallel_for(0, bs * kv_heads, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    std::vector<__m512> acc(group * chunks);
    std::vector<__m512> qv(group * chunks);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / kv_heads, g = w % kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      const int64_t* slots = table + rows[b] * table_stride + start;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t left = std::min<int64_t>(16, dim - 16 * c);
          const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
          const float* qh = q + (b * heads + g * group + h) * dim;
          qv[h * chunks + c] = _mm512_maskz_loadu_ps(m, qh + 16 * c);
        }
      scores.assign(group * n, 0.f);
      const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(T));
      for (int64_t t = 0; t < n; ++t) {
        if (t + kAhead < n) prefetch_row(kbuf + (slots[t + kAhead] * kv_heads + g) * dim, row_bytes);
        const T* k = kbuf + (slots[t] * kv_heads + g) * dim;
        for (int64_t h = 0; h < group; ++h) {
          __m512 s = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t left = std::min<int64_t>(16, dim - 16 * c);
            const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
            s = _mm512_fmadd_ps(qv[h * chunks + c], load16(k + 16 * c, m), s);
          }
          float x = _mm512_reduce_add_ps(s) * static_cast<float>(scale);
          if (cap > 0) x = static_cast<float>(cap) * std::tanh(x / static_cast<float>(cap));
          scores[h * n + t] = x;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        float mx = -INFINITY;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 16) {
          const __mmask16 m = static_cast<__mmask16>(
              n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vmx)));
          _mm512_mask_storeu_ps(s + t, m, e);
          sum = _mm512_add_ps(sum, e);
        }
        const float inv = 1.f / _mm512_reduce_add_ps(sum);
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        if (t + kAhead < n) prefetch_row(vbuf + (slots[t + kAhead] * kv_heads + g) * dim, row_bytes);
        const T* v = vbuf + (slots[t] * kv_heads + g) * dim;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t left = std::min<int64_t>(16, dim - 16 * c);
          const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
          const __m512 vv = load16(v + 16 * c, m);
          for (int64_t h = 0; h < group; ++h)
            acc[h * chunks + c] =
                _mm512_fmadd_ps(_mm512_set1_ps(scores[h * n + t]), vv, acc[h * chunks + c]);
        }
      }
      for (int64_t h = 0; h < group; ++h)
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t left = std::min<int64_t>(16, dim - 16 * c);
          const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
          _mm512_mask_storeu_ps(out + (b * heads + g * group + h) * dim + 16 * c, m,
                                acc[h * chunks + c]);
        }
    }
  });
}

// q [bs, heads, dim] float32; k_buf / v_buf [slots, kv_heads, dim] float32 or bfloat16;
// table [rows, max_context] int64 (slots by position); rows, seq_lens [bs] int64.
// Returns [bs, heads, dim] float32.
at::Tensor paged_decode(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
    const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, double scale,
    int64_t window, double cap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode: q [bs, heads, dim] float32, contiguous");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.scalar_type() == v_buf.scalar_type(),
              "paged_decode: k_buf / v_buf [slots, kv_heads, dim], contiguous, one dtype");
  TORCH_CHECK(table.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && table.is_contiguous(),
              "paged_decode: table, rows and seq_lens int64");
  const int64_t bs = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_buf.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_buf.size(2) == dim, "paged_decode: head shapes");
  auto out = at::empty_like(q);
  const auto r = rows.contiguous(), l = seq_lens.contiguous();
  if (k_buf.scalar_type() == at::kFloat) {
    decode_impl<float>(q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(),
                       table.data_ptr<int64_t>(), table.size(1), r.data_ptr<int64_t>(),
                       l.data_ptr<int64_t>(), bs, heads, kv_heads, dim, scale, window, cap,
                       out.data_ptr<float>());
  } else {
    TORCH_CHECK(k_buf.scalar_type() == at::kBFloat16, "paged_decode: KV float32 or bfloat16");
    decode_impl<c10::BFloat16>(
        q.data_ptr<float>(), k_buf.data_ptr<c10::BFloat16>(), v_buf.data_ptr<c10::BFloat16>(),
        table.data_ptr<int64_t>(), table.size(1), r.data_ptr<int64_t>(), l.data_ptr<int64_t>(),
        bs, heads, kv_heads, dim, scale, window, cap, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(loom_cpu_attn, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_buf, Tensor v_buf, Tensor table, Tensor rows, "
      "Tensor seq_lens, float scale, int window, float cap) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom_cpu_attn, CPU, m) { m.impl("paged_decode", &paged_decode); }
