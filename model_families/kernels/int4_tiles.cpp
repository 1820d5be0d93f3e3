// warmserve's int4 weight-only matmul for bf16 activations on AVX512-BF16 CPUs:
// torch.ops.warmserve.int4_mm_tiles(x, tiles, group_size, scales_zeros) -> y.
//
//   x             bf16  [M, K], contiguous
//   tiles         uint8 [N/16, K/8, 64]: tile t holds output rows 16t..16t+15; its chunk c covers
//                 k = 8c..8c+7. The chunk's 64 bytes are 32 little-endian uint16 words; word l
//                 holds, in nibble h (bits 4h..4h+3), the code q[16t + l/2, 8c + 2h + l%2]
//                 (model_families/quantized_weights.py: pack_int4_tiles writes it).
//   scales_zeros  bf16  [N/16, K/G, 2, 16]: per tile and group, the 16 rows' scales, then zeros
//   y             bf16  [M, N]:  y[m, n] = sum_k x[m, k] * ((q[n, k] - 8) * s[n, k/G] + z[n, k/G])
//
// The formula is PyTorch's int4 weight-only kernel's (_weight_int4pack_mm_for_cpu). Per group of G
// codes it is computed as s * sum_k x_k (128 + q_k) + (z - 136 s) * sum_k x_k: the bf16 bit
// pattern 0x4300 | q is exactly 128 + q, so a code becomes a bf16 operand with one vpternlogd,
// and vdpbf16ps multiplies pairs of bf16 exactly and accumulates them in fp32. A row's result
// depends on that row alone (no split of K across threads, the same instruction order for any M).
//
// torch.ops.warmserve.int4_mm_tiles_a8 / int8_mm_tiles_a8 (same arguments, AVX512-VNNI): the same
// products with x quantized to int8 per row and group (the "int8 activations" section below).
//
// torch.ops.warmserve.int8_mm_tiles(x, tiles, group_size, scales_zeros): the same for int8 codes q
// (-127..127) with one scale per group and no zero, w = q * s (llama.cpp's Q8_0): tiles uint8
// [N/16, K/4, 64], word l of chunk c holding u = q + 128 of row 16t + l/2 at k = 4c + l%2 in its
// low byte and at k + 2 in its high byte; scales_zeros as above with the zeros unused.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

#define WS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

WS_TARGET inline __m512 bf16x16_to_f32(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// sx[m, g] = sum of row m's x over group g, in float32 (each thread sums the rows it needs).
WS_TARGET void group_sums(const uint16_t* x, int64_t rows, int64_t K, int64_t G, float* sx) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < G; k += 32) {
        const __mmask32 lanes = G - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (G - k)) - 1;
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(lanes, x + m * K + g * G + k), ones);
      }
      sx[m * (K / G) + g] = _mm512_reduce_add_ps(acc);
    }
}

// MB rows of x times NT tiles starting at tile t0: the accumulators stay in registers. Bits 4: a
// chunk is 8 columns of k, nibble h of a word pairs with x[k + 2h]; Bits 8: a chunk is 4 columns,
// nibbles 0 / 2 are the low halves of u = q + 128 at k / k + 2 (paired with x), 1 / 3 their high
// halves (paired with x16 = 16 x, exact in bf16), so one sum carries sum_k x_k (2176 + u_k).
template <int Bits, int MB, int NT>
WS_TARGET void tile_block(const uint16_t* x, const uint16_t* x16, int64_t ldx, const float* sx, int64_t ldsx,
                          const uint8_t* w, const uint16_t* sz, int64_t K, int64_t G, uint16_t* y, int64_t ldy,
                          int64_t t0) {
  const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  constexpr int64_t kc = Bits == 4 ? 8 : 4;  // columns of k per chunk
  const int64_t chunks = K / kc, groups = K / G, group_chunks = G / kc;
  alignas(64) float out[MB][NT][16];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) _mm512_store_ps(out[m][t], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MB][NT];
    for (int m = 0; m < MB; ++m)
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < group_chunks; ++c) {
      const int64_t k = g * G + kc * c;
      __m512i raw[NT];
      for (int t = 0; t < NT; ++t) raw[t] = _mm512_loadu_si512(w + ((t0 + t) * chunks + g * group_chunks + c) * 64);
#pragma GCC unroll 4
      for (int h = 0; h < 4; ++h) {
        __m512bh b[NT];
        for (int t = 0; t < NT; ++t)  // (word >> 4h) & 0xF | 0x4300: the bf16 of 128 + q
          b[t] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(raw[t], 4 * h), low4, bias, 0xEA);
        for (int m = 0; m < MB; ++m) {
          int32_t pair;
          const uint16_t* xa = Bits == 4 ? x + m * ldx + k + 2 * h : ((h & 1) ? x16 : x) + m * ldx + k + (h & 2);
          std::memcpy(&pair, xa, sizeof(pair));
          const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
          for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, b[t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint16_t* p = sz + ((t0 + t) * groups + g) * 32;
      const __m512 s = bf16x16_to_f32(p), z = bf16x16_to_f32(p + 16);
      const __m512 off = Bits == 4 ? _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, z)  // z - (8 + 128) s
                                   : _mm512_mul_ps(_mm512_set1_ps(-2304.f), s);  // -(2176 + 128) s
      for (int m = 0; m < MB; ++m) {
        const __m512 o = _mm512_fmadd_ps(acc[m][t], s, _mm512_load_ps(out[m][t]));
        _mm512_store_ps(out[m][t], _mm512_fmadd_ps(_mm512_set1_ps(sx[m * ldsx + g]), off, o));
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_load_ps(out[m][t]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + (t0 + t) * 16), (__m256i)r);
    }
}

// Rows per block (the accumulators of MB <= 8 rows stay in registers) and rows per pass: a
// thread runs every row block of a pass over NT tiles before it moves to the next NT tiles, so
// those tiles' codes are read from memory once per pass and from L1 for the pass's other blocks.
constexpr int kRowBlock = 8;
constexpr int64_t kPassRows = 64;

// One function per (rows in the block, tiles at a time): tiles at a time is 8 for a one-row pass
// (a batch-1 step), else 2, and 1 for the range's last odd tile.
template <class Fn, template <int, int> class Block, int... I>
constexpr auto make_blocks(std::integer_sequence<int, I...>) {
  return std::array<std::array<Fn, sizeof...(I)>, 3>{{{Block<I + 1, 1>::run...}, {Block<I + 1, 2>::run...},
                                                      {Block<I + 1, 8>::run...}}};
}

// Calls call(sel, block rows, block's first row, t) for every block of RB rows of a pass of `rows`
// rows, NT tiles at a time from t (sel: 0, 1, 2 for NT = 1, 2, 8).
template <int RB, class Call>
void tile_major(int64_t rows, int64_t begin, int64_t end, Call call) {
  const int nt = rows == 1 ? 8 : 2, sel = rows == 1 ? 2 : 1;
  int64_t t = begin;
  for (; t + nt <= end; t += nt)
    for (int64_t m = 0; m < rows; m += RB) call(sel, std::min<int64_t>(RB, rows - m), m, t);
  for (; t < end; ++t)
    for (int64_t m = 0; m < rows; m += RB) call(0, std::min<int64_t>(RB, rows - m), m, t);
}

using BlockFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const float*, int64_t, const uint8_t*,
                         const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int64_t);
template <int Bits>
struct BF16Blocks {
  template <int MB, int NT>
  struct B {
    static void run(const uint16_t* x, const uint16_t* x16, int64_t ldx, const float* sx, int64_t ldsx,
                    const uint8_t* w, const uint16_t* sz, int64_t K, int64_t G, uint16_t* y, int64_t ldy, int64_t t0) {
      tile_block<Bits, MB, NT>(x, x16, ldx, sx, ldsx, w, sz, K, G, y, ldy, t0);
    }
  };
};
constexpr auto kBlocks4 = make_blocks<BlockFn, BF16Blocks<4>::B>(std::make_integer_sequence<int, kRowBlock>{});
constexpr auto kBlocks8 = make_blocks<BlockFn, BF16Blocks<8>::B>(std::make_integer_sequence<int, kRowBlock>{});

// x16 = 16 x for `rows` rows of K bf16 values (exact: a power of two).
void times16(const uint16_t* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    v *= 16.f;
    std::memcpy(&bits, &v, sizeof(v));
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// ---- int8 activations (W4A8 / W8A8 on AVX512-VNNI) ----------------------------------------
// Each row's x is quantized per group of G: d = amax / 127, xq = nearbyint(x * (127 / amax)) in
// -127..127 (llama.cpp's Q8 activations; amax = 0 gives xq = 0). vpdpbusd multiplies the tiles'
// unsigned codes by xq, four byte pairs a lane, exactly in int32, so a group costs half the
// multiply instructions of the bf16 path. Per group g and output n:
//   int4: y += s d sum_k xq_k q_k + (z - 8 s) sum_k x_k       (the zero term from the exact x)
//   int8: y += s d (sum_k xq_k u_k - 128 sum_k xq_k)          (u = q + 128)
// A lane's four bytes of one chunk are, in k order: int4 [0, 4, 1, 5] (low nibbles) and [2, 6, 3, 7]
// (high nibbles) of the chunk's 8 columns; int8 [0, 2, 1, 3] of its 4. xq is stored in that order,
// so one 32-bit broadcast of xq pairs with a lane.
// int4 only: a row's outliers, its at most kOutliers largest |x_k| above kOutlierRatio times its
// mean |x| (ties: the lower k), are not quantized (x_k = 0 in xq and in sum_k x_k) but added exactly
// after the groups, y += x_k ((q_k - 8) s + z), in ascending k (LLM.int8()'s mixed decomposition,
// chosen per row): a row's few massive activations would otherwise coarsen their group's steps.
// A row's result depends on that row alone.
constexpr int kOutliers = 4;
constexpr float kOutlierRatio = 10.f;
// Bit offset of column j of a chunk in its lane: j = 0, 4, 1, 5 in bytes 0-3's low nibbles, 2, 6, 3, 7
// in their high nibbles.
constexpr int kNibbleShift[8] = {0, 16, 4, 20, 8, 24, 12, 28};

#define WS_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

// The outliers of a row of K floats xf whose |x| sum to abs_sum, in ascending k: their k and x_k;
// k = -1 (first) for slots left empty. Blocks of 16 whose largest |x| cannot enter are skipped with
// one compare.
WS_TARGET_VNNI void row_outliers(const float* xf, int64_t K, float abs_sum, int32_t* idx, float* val) {
  float mag[kOutliers];
  int32_t at[kOutliers];
  const float floor = kOutlierRatio * abs_sum / static_cast<float>(K);
  for (int j = 0; j < kOutliers; ++j) mag[j] = floor, at[j] = -1;
  for (int64_t k = 0; k < K; ++k) {
    if (k % 16 == 0 && !(_mm512_reduce_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xf + k))) > mag[kOutliers - 1])) {
      k += 15;
      continue;
    }
    const float a = std::fabs(xf[k]);
    if (!(a > mag[kOutliers - 1])) continue;  // (a NaN never enters: it poisons its group instead)
    int j = kOutliers - 1;
    for (; j > 0 && a > mag[j - 1]; --j) mag[j] = mag[j - 1], at[j] = at[j - 1];
    mag[j] = a, at[j] = static_cast<int32_t>(k);
  }
  std::sort(at, at + kOutliers);
  for (int j = 0; j < kOutliers; ++j) idx[j] = at[j], val[j] = at[j] < 0 ? 0.f : xf[at[j]];
}

// xq (permuted as above), d and, for int4, sx = sum_k x_k and the outliers (oidx, oval: kOutliers a
// row), for int8 cq = 128 sum_k xq_k, per row and group of `rows` rows of x. G is a multiple of 16;
// xf is scratch for one row of K floats.
template <int Bits>
WS_TARGET_VNNI void quantize_rows(const uint16_t* x, int64_t rows, int64_t K, int64_t G, int8_t* xq, float* d,
                                  float* sx, int32_t* cq, int32_t* oidx, float* oval, float* xf) {
  const __m128i perm = Bits == 4 ? _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
                                 : _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  const int64_t groups = K / G;
  for (int64_t m = 0; m < rows; ++m) {
    __m512 abs_sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = bf16x16_to_f32(x + m * K + k);
      _mm512_storeu_ps(xf + k, v);
      abs_sum = _mm512_add_ps(abs_sum, _mm512_abs_ps(v));
    }
    if (Bits == 4) {
      row_outliers(xf, K, _mm512_reduce_add_ps(abs_sum), oidx + m * kOutliers, oval + m * kOutliers);
      for (int j = 0; j < kOutliers; ++j)
        if (oidx[m * kOutliers + j] >= 0) xf[oidx[m * kOutliers + j]] = 0.f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float* p = xf + g * G;
      __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
      for (int64_t k = 0; k < G; k += 16) {
        const __m512 v = _mm512_loadu_ps(p + k);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vsum = _mm512_add_ps(vsum, v);
      }
      const float amax = _mm512_reduce_max_ps(vmax), sum = _mm512_reduce_add_ps(vsum);  // sum: NaN / inf carried
      float scale = amax > 0.f ? 127.f / amax : 0.f;
      if (!std::isfinite(scale)) scale = 0.f;  // amax below ~3.7e-37: the group rounds to zero
      const __m512 inv = _mm512_set1_ps(scale), lim = _mm512_set1_ps(127.f);
      __m512i qsum = _mm512_setzero_si512();
      for (int64_t k = 0; k < G; k += 16) {  // nearest, ties even; clamped (a NaN or inf lands in range)
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(p + k), inv);
        const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim));
        qsum = _mm512_add_epi32(qsum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + g * G + k),
                         _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(q), perm));
      }
      d[m * groups + g] = std::isfinite(sum) ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();  // NaN in, NaN out
      if (Bits == 4) sx[m * groups + g] = sum;
      else cq[m * groups + g] = 128 * _mm512_reduce_add_epi32(qsum);
    }
  }
}

template <int Bits, int MB, int NT>
WS_TARGET_VNNI void tile_block_a8(const int8_t* xq, const float* d, const float* sx, const int32_t* cq,
                                  const int32_t* oidx, const float* oval, int64_t ldx, int64_t ldg,
                                  const uint8_t* w, const uint16_t* sz, int64_t K, int64_t G, uint16_t* y,
                                  int64_t ldy, int64_t t0) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  constexpr int64_t kc = Bits == 4 ? 8 : 4;
  const int64_t chunks = K / kc, groups = K / G, group_chunks = G / kc;
  alignas(64) float out[MB][NT][16];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) _mm512_store_ps(out[m][t], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MB][NT];
    for (int m = 0; m < MB; ++m)
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t c = 0; c < group_chunks; ++c) {
      const int64_t k = g * G + kc * c;
      __m512i lo[NT], hi[NT];
      for (int t = 0; t < NT; ++t) {
        const __m512i raw = _mm512_loadu_si512(w + ((t0 + t) * chunks + g * group_chunks + c) * 64);
        if (Bits == 4) {
          lo[t] = _mm512_and_si512(raw, low4);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        } else {
          lo[t] = raw;
        }
      }
      for (int m = 0; m < MB; ++m) {
        int32_t q0;
        std::memcpy(&q0, xq + m * ldx + k, sizeof(q0));
        const __m512i a0 = _mm512_set1_epi32(q0);
        for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbusd_epi32(acc[m][t], lo[t], a0);
        if (Bits == 4) {
          int32_t q1;
          std::memcpy(&q1, xq + m * ldx + k + 4, sizeof(q1));
          const __m512i a1 = _mm512_set1_epi32(q1);
          for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbusd_epi32(acc[m][t], hi[t], a1);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint16_t* p = sz + ((t0 + t) * groups + g) * 32;
      const __m512 s = bf16x16_to_f32(p);
      const __m512 off = Bits == 4 ? _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16x16_to_f32(p + 16)) : s;
      for (int m = 0; m < MB; ++m) {
        __m512i a = acc[m][t];
        if (Bits == 8) a = _mm512_sub_epi32(a, _mm512_set1_epi32(cq[m * ldg + g]));
        __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(s, _mm512_set1_ps(d[m * ldg + g])),
                                   _mm512_load_ps(out[m][t]));
        if (Bits == 4) o = _mm512_fmadd_ps(_mm512_set1_ps(sx[m * ldg + g]), off, o);
        _mm512_store_ps(out[m][t], o);
      }
    }
  }
  if (Bits == 4)  // the outliers, exactly: x_k ((q_k - 8) s + z) for each row's own columns
    for (int t = 0; t < NT; ++t) {
      alignas(64) float wk[kOutliers * MB][16];  // column k's 16 weights, once per column of the block
      int64_t ks[kOutliers * MB];
      int known = 0;
      for (int m = 0; m < MB; ++m) {
        __m512 o = _mm512_load_ps(out[m][t]);
        for (int j = 0; j < kOutliers; ++j) {
          const int64_t k = oidx[m * kOutliers + j];
          if (k < 0) continue;
          int i = 0;
          while (i < known && ks[i] != k) ++i;
          if (i == known) {
            const __m512i raw = _mm512_loadu_si512(w + ((t0 + t) * chunks + k / 8) * 64);
            const __m512i q = _mm512_and_si512(_mm512_srl_epi32(raw, _mm_cvtsi32_si128(kNibbleShift[k % 8])),
                                               _mm512_set1_epi32(0xF));
            const uint16_t* p = sz + ((t0 + t) * groups + k / G) * 32;
            const __m512 s = bf16x16_to_f32(p);
            const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, bf16x16_to_f32(p + 16));
            _mm512_store_ps(wk[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, off));
            ks[known++] = k;
          }
          o = _mm512_fmadd_ps(_mm512_set1_ps(oval[m * kOutliers + j]), _mm512_load_ps(wk[i]), o);
        }
        _mm512_store_ps(out[m][t], o);
      }
    }
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < NT; ++t) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_load_ps(out[m][t]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + (t0 + t) * 16), (__m256i)r);
    }
}

using BlockFnA8 = void (*)(const int8_t*, const float*, const float*, const int32_t*, const int32_t*, const float*,
                           int64_t, int64_t, const uint8_t*, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t,
                           int64_t);
template <int Bits>
struct A8Blocks {
  template <int MB, int NT>
  struct B {
    static void run(const int8_t* xq, const float* d, const float* sx, const int32_t* cq, const int32_t* oidx,
                    const float* oval, int64_t ldx, int64_t ldg, const uint8_t* w, const uint16_t* sz, int64_t K,
                    int64_t G, uint16_t* y, int64_t ldy, int64_t t0) {
      tile_block_a8<Bits, MB, NT>(xq, d, sx, cq, oidx, oval, ldx, ldg, w, sz, K, G, y, ldy, t0);
    }
  };
};
// Four rows a block: the int32 accumulators of 4 rows x 2 tiles leave registers for the codes and
// x's broadcasts (8 rows measured no faster, and slower from 64 rows on).
constexpr int kRowBlockA8 = 4;
constexpr auto kBlocksA8_4 = make_blocks<BlockFnA8, A8Blocks<4>::B>(std::make_integer_sequence<int, kRowBlockA8>{});
constexpr auto kBlocksA8_8 = make_blocks<BlockFnA8, A8Blocks<8>::B>(std::make_integer_sequence<int, kRowBlockA8>{});

bool a8_supported() { return supported() && __builtin_cpu_supports("avx512vnni"); }

at::Tensor mm_tiles(const at::Tensor& x, const at::Tensor& codes, int64_t group_size, const at::Tensor& scales_zeros,
                    int bits, bool a8) {
  const char* op = bits == 4 ? (a8 ? "int4_mm_tiles_a8" : "int4_mm_tiles") : (a8 ? "int8_mm_tiles_a8" : "int8_mm_tiles");
  const int64_t kc = bits == 4 ? 8 : 4;
  TORCH_CHECK(a8 ? a8_supported() : supported(), "warmserve::", op, " needs AVX512-BF16", a8 ? " and AVX512-VNNI" : "",
              ", which this CPU lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a 2-D bf16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  const int64_t align = a8 ? 16 : 8;
  TORCH_CHECK(G > 0 && G % align == 0 && K % G == 0, "group_size ", G, " must be a multiple of ", align,
              " dividing K = ", K);
  TORCH_CHECK(!a8 || G <= 4096, "group_size ", G, " is above 4096, where a group's int32 sum could overflow");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(1) == K / kc && codes.size(2) == 64 &&
                  codes.is_contiguous(),
              "tiles must be contiguous uint8 [N/16, K/", kc, ", 64] with K = ", K, ", got ", codes.sizes());
  const int64_t tiles = codes.size(0), N = tiles * 16, groups = K / G;
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.sizes() == at::IntArrayRef({tiles, groups, 2, 16}),
              "scales_zeros must be contiguous bf16 [N/16, K/group_size, 2, 16] = [", tiles, ", ", groups,
              ", 2, 16], got ", scales_zeros.sizes(), " ", scales_zeros.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
  const auto* wp = codes.const_data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scales_zeros.const_data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const int64_t pass = std::min<int64_t>(M, kPassRows);
  if (a8) {
    const auto& blocks = bits == 4 ? kBlocksA8_4 : kBlocksA8_8;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<int8_t> xq(static_cast<size_t>(pass * K));
      std::vector<float> d(static_cast<size_t>(pass * groups)), sx(bits == 4 ? d.size() : 0), xf(K);
      std::vector<int32_t> cq(bits == 8 ? d.size() : 0), oidx(bits == 4 ? pass * kOutliers : 0);
      std::vector<float> oval(oidx.size());
      for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
        const int64_t rows = std::min<int64_t>(kPassRows, M - m0);
        if (bits == 4)
          quantize_rows<4>(xp + m0 * K, rows, K, G, xq.data(), d.data(), sx.data(), nullptr, oidx.data(), oval.data(),
                           xf.data());
        else
          quantize_rows<8>(xp + m0 * K, rows, K, G, xq.data(), d.data(), nullptr, cq.data(), nullptr, nullptr, xf.data());
        tile_major<kRowBlockA8>(rows, begin, end, [&](int sel, int64_t mb, int64_t m, int64_t t) {
          blocks[sel][mb - 1](xq.data() + m * K, d.data() + m * groups, bits == 4 ? sx.data() + m * groups : nullptr,
                              bits == 8 ? cq.data() + m * groups : nullptr,
                              bits == 4 ? oidx.data() + m * kOutliers : nullptr,
                              bits == 4 ? oval.data() + m * kOutliers : nullptr, K, groups, wp, szp, K, G,
                              yp + (m0 + m) * N, N, t);
        });
      }
    });
    return y;
  }
  const auto& blocks = bits == 4 ? kBlocks4 : kBlocks8;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sx(static_cast<size_t>(pass * groups));
    std::vector<uint16_t> x16(bits == 8 ? static_cast<size_t>(pass * K) : 0);
    for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
      const int64_t rows = std::min<int64_t>(kPassRows, M - m0);
      group_sums(xp + m0 * K, rows, K, G, sx.data());
      if (bits == 8) times16(xp + m0 * K, rows * K, x16.data());
      tile_major<kRowBlock>(rows, begin, end, [&](int sel, int64_t mb, int64_t m, int64_t t) {
        blocks[sel][mb - 1](xp + (m0 + m) * K, bits == 8 ? x16.data() + m * K : nullptr, K, sx.data() + m * groups,
                            groups, wp, szp, K, G, yp + (m0 + m) * N, N, t);
      });
    }
  });
  return y;
}

at::Tensor int4_mm_tiles(const at::Tensor& x, const at::Tensor& codes, int64_t group_size,
                         const at::Tensor& scales_zeros) {
  return mm_tiles(x, codes, group_size, scales_zeros, 4, false);
}

at::Tensor int8_mm_tiles(const at::Tensor& x, const at::Tensor& codes, int64_t group_size, const at::Tensor& scales) {
  return mm_tiles(x, codes, group_size, scales, 8, false);
}

at::Tensor int4_mm_tiles_a8(const at::Tensor& x, const at::Tensor& codes, int64_t group_size,
                            const at::Tensor& scales_zeros) {
  return mm_tiles(x, codes, group_size, scales_zeros, 4, true);
}

at::Tensor int8_mm_tiles_a8(const at::Tensor& x, const at::Tensor& codes, int64_t group_size,
                            const at::Tensor& scales) {
  return mm_tiles(x, codes, group_size, scales, 8, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(warmserve, m) {
  m.def("int4_mm_tiles(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor");
  m.def("int8_mm_tiles(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor");
  m.def("int4_mm_tiles_a8(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor");
  m.def("int8_mm_tiles_a8(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor");
  m.def("int4_tiles_supported() -> bool", &supported);
  m.def("int8_activations_supported() -> bool", &a8_supported);
}

TORCH_LIBRARY_IMPL(warmserve, CPU, m) {
  m.impl("int4_mm_tiles", &int4_mm_tiles);
  m.impl("int8_mm_tiles", &int8_mm_tiles);
  m.impl("int4_mm_tiles_a8", &int4_mm_tiles_a8);
  m.impl("int8_mm_tiles_a8", &int8_mm_tiles_a8);
}
