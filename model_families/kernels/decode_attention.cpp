// warmserve's paged decode attention for AVX-512 CPUs (one query token per row):
// torch.ops.warmserve.decode_attention(q, k_pool, v_pool, block_tables, positions, seq_lens, k_new, v_new).
//
//   q                [B, 1, nh, hd]              bf16 or float32 (the pools' dtype), hd % 16 == 0
//   k_pool, v_pool   [num_blocks, bs, nkv, hd]   one layer's pools; slot = block * bs + offset
//   block_tables     int64 [B, nb]; positions int64 [B, 1]; seq_lens int64 [B]
//   k_new, v_new     [B, 1, nkv, hd] or None: the step's own K/V, standing in for the pools' entry
//                    at t == positions[b] (the caller writes the pools after the step)
//   returns          [B, 1, nh, hd] in q's dtype
//
// Key t (its place in the row's block table) is visible iff t <= positions[b] and t < seq_lens[b],
// as in model_families/attention.py decode_attention, the reference this computes (float32 scores
// s = q . k / sqrt(hd), softmax over the visible keys, out = sum_t p_t v_t). Unlike that reference
// a row reads only its visible keys, not the batch's padded width. A row with no visible key gets
// zeros. Work is split by (row, KV head): the query heads of a GQA group share each K/V load.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

#define WS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

WS_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
WS_TARGET inline __m512 load16(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
WS_TARGET inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
WS_TARGET inline void store16(c10::BFloat16* p, __m512 v) {  // round to nearest even, as torch's .to(bf16)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// exp(x) for x <= 0 (a score minus the running maximum): 2^n * 2^f, f in [-0.5, 0.5], a degree-6
// polynomial for 2^f (relative error below 2e-7); inputs below -87 give 0.
WS_TARGET inline __m512 exp_nonpositive(__m512 x) {
  // max(-87, x) with x second: a NaN score stays NaN (vmaxps returns its second operand then)
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(-87.f), x), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // ln 2 * frac
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512 r = _mm512_scalef_ps(p, n);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ), r, _mm512_setzero_ps());
}

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxChunks = 16;  // hd / 16

// One (row, KV head): the g query heads over the n visible keys.
template <typename T>
WS_TARGET void attend(const T* q, const T* k_pool, const T* v_pool, const int64_t* table, int64_t n, int64_t pos,
                      const T* k_new, const T* v_new, int64_t bs, int64_t nkv, int64_t kvh, int g, int64_t hd,
                      float* scores, T* out) {
  const int chunks = static_cast<int>(hd / 16);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  if (n <= 0) {
    for (int j = 0; j < g; ++j)
      for (int c = 0; c < chunks; ++c) store16(out + j * hd + c * 16, _mm512_setzero_ps());
    return;
  }
  __m512 qv[kMaxGroup][kMaxChunks];
  for (int j = 0; j < g; ++j)
    for (int c = 0; c < chunks; ++c) qv[j][c] = _mm512_mul_ps(load16(q + j * hd + c * 16), _mm512_set1_ps(scale));
  // Calls f(t, K row, V row) for t = 0 .. n - 1, block by block (no division per key).
  auto for_keys = [&](auto&& f) WS_TARGET {
    for (int64_t t0 = 0, blk = 0; t0 < n; t0 += bs, ++blk) {
      const int64_t base = table[blk] * bs * nkv * hd + kvh * hd, stop = std::min(bs, n - t0);
      for (int64_t o = 0; o < stop; ++o) {
        const int64_t t = t0 + o;
        const bool fresh = k_new != nullptr && t == pos;
        f(t, fresh ? k_new + kvh * hd : k_pool + base + o * nkv * hd, fresh ? v_new + kvh * hd : v_pool + base + o * nkv * hd);
      }
    }
  };
  // scores[j * n + t] = q_j . k_t / sqrt(hd)
  for_keys([&](int64_t t, const T* kp, const T*) WS_TARGET {
    __m512 acc[kMaxGroup];
    for (int j = 0; j < g; ++j) acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      const __m512 kv = load16(kp + c * 16);
      for (int j = 0; j < g; ++j) acc[j] = _mm512_fmadd_ps(qv[j][c], kv, acc[j]);
    }
    for (int j = 0; j < g; ++j) scores[j * n + t] = _mm512_reduce_add_ps(acc[j]);
  });
  // softmax over t, per query head
  float inv_sum[kMaxGroup];
  for (int j = 0; j < g; ++j) {
    float* s = scores + j * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t)
      if (!(s[t] <= mx)) mx = s[t];  // a NaN becomes the maximum, so the row's output is NaN
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mv));
      _mm512_mask_storeu_ps(s + t, m, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    inv_sum[j] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // out_j = sum_t p_jt v_t
  __m512 o[kMaxGroup][kMaxChunks];
  for (int j = 0; j < g; ++j)
    for (int c = 0; c < chunks; ++c) o[j][c] = _mm512_setzero_ps();
  for_keys([&](int64_t t, const T*, const T* vp) WS_TARGET {
    for (int c = 0; c < chunks; ++c) {
      const __m512 vv = load16(vp + c * 16);
      for (int j = 0; j < g; ++j) o[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * n + t]), vv, o[j][c]);
    }
  });
  for (int j = 0; j < g; ++j)
    for (int c = 0; c < chunks; ++c) store16(out + j * hd + c * 16, _mm512_mul_ps(o[j][c], _mm512_set1_ps(inv_sum[j])));
}

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& positions, const at::Tensor& seq_lens,
                            const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new) {
  TORCH_CHECK(supported(), "warmserve::decode_attention needs AVX-512, which this CPU lacks");
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1, "q must be [B, 1, nh, hd], got ", q.sizes());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(),
              "k_pool and v_pool must be [num_blocks, bs, nkv, hd] alike, got ", k_pool.sizes(), " and ", v_pool.sizes());
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k_pool.scalar_type() == dt && v_pool.scalar_type() == dt,
              "q and the pools must share one dtype, float32 or bfloat16");
  const int64_t B = q.size(0), nh = q.size(2), hd = q.size(3), bs = k_pool.size(1), nkv = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == hd && hd % 16 == 0 && hd / 16 <= kMaxChunks,
              "head dim ", hd, " must match the pools' and be a multiple of 16 up to ", 16 * kMaxChunks);
  TORCH_CHECK(nkv > 0 && nh % nkv == 0 && nh / nkv <= kMaxGroup, "query heads ", nh, " must be a multiple of the KV heads ",
              nkv, ", at most ", kMaxGroup, " per KV head");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kLong &&
                  positions.numel() == B && positions.scalar_type() == at::kLong && seq_lens.numel() == B &&
                  seq_lens.scalar_type() == at::kLong,
              "block_tables int64 [B, nb], positions int64 [B, 1] and seq_lens int64 [B] must match q's B = ", B);
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "give the step's own K and V together (k_new and v_new), or neither");
  at::Tensor kn, vn;
  if (k_new.has_value()) {
    kn = k_new->contiguous();
    vn = v_new->contiguous();
    const std::array<int64_t, 4> shape{B, 1, nkv, hd};
    const at::IntArrayRef want(shape);
    TORCH_CHECK(kn.sizes() == want && vn.sizes() == want && kn.scalar_type() == dt && vn.scalar_type() == dt,
                "k_new and v_new must be [B, 1, nkv, hd] = ", want, " in q's dtype, got ", kn.sizes(), " and ",
                vn.sizes());
  }
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "k_pool and v_pool must be contiguous");
  const at::Tensor qc = q.contiguous(), kc = k_pool, vc = v_pool;
  const at::Tensor tables = block_tables.contiguous(), pos = positions.contiguous(), lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  const int64_t nb = tables.size(1), g = nh / nkv;
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  // keys visible to each row (t <= position, t < seq_len, t < the table's width), clamped before any
  // arithmetic; every table entry those keys use must name a block of the pools
  const int64_t num_blocks = k_pool.size(0), width = nb * bs;
  std::vector<int64_t> visible(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = std::clamp<int64_t>(pp[b], -1, width), l = std::clamp<int64_t>(lp[b], 0, width);
    visible[b] = std::min(p + 1, l);
    for (int64_t j = 0; j * bs < visible[b]; ++j)
      TORCH_CHECK(tp[b * nb + j] >= 0 && tp[b * nb + j] < num_blocks, "block_tables[", b, ", ", j, "] = ",
                  tp[b * nb + j], " is not a block of the pools (", num_blocks, " blocks)");
  }
  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    const auto* qp = reinterpret_cast<const scalar_t*>(qc.const_data_ptr());
    const auto* kp = reinterpret_cast<const scalar_t*>(kc.const_data_ptr());
    const auto* vp = reinterpret_cast<const scalar_t*>(vc.const_data_ptr());
    const auto* knp = kn.defined() ? reinterpret_cast<const scalar_t*>(kn.const_data_ptr()) : nullptr;
    const auto* vnp = vn.defined() ? reinterpret_cast<const scalar_t*>(vn.const_data_ptr()) : nullptr;
    auto* op = reinterpret_cast<scalar_t*>(out.mutable_data_ptr());
    at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / nkv, kvh = item % nkv;
        const int64_t n = visible[b];
        scores.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * g));
        attend<scalar_t>(qp + (b * nh + kvh * g) * hd, kp, vp, tp + b * nb, n, pp[b],
                         knp ? knp + b * nkv * hd : nullptr, vnp ? vnp + b * nkv * hd : nullptr, bs, nkv, kvh,
                         static_cast<int>(g), hd, scores.data(), op + (b * nh + kvh * g) * hd);
      }
    });
  };
  if (dt == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<c10::BFloat16*>(nullptr));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(warmserve, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor positions, "
        "Tensor seq_lens, Tensor? k_new=None, Tensor? v_new=None) -> Tensor");
  m.def("decode_attention_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(warmserve, CPU, m) { m.impl("decode_attention", &decode_attention); }
