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
// torch.ops.warmserve.int8_mm_tiles(x, tiles, group_size, scales_zeros): the same for int8 codes q
// (-127..127) with one scale per group and no zero, w = q * s (llama.cpp's Q8_0): tiles uint8
// [N/16, K/4, 64], word l of chunk c holding u = q + 128 of row 16t + l/2 at k = 4c + l%2 in its
// low byte and at k + 2 in its high byte; scales_zeros as above with the zeros unused.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
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

template <int Bits, int MB, int NT>
void tile_range(const uint16_t* x, const uint16_t* x16, int64_t ldx, const float* sx, int64_t ldsx, const uint8_t* w,
                const uint16_t* sz, int64_t K, int64_t G, uint16_t* y, int64_t ldy, int64_t begin, int64_t end) {
  int64_t t = begin;
  for (; t + NT <= end; t += NT) tile_block<Bits, MB, NT>(x, x16, ldx, sx, ldsx, w, sz, K, G, y, ldy, t);
  for (; t < end; ++t) tile_block<Bits, MB, 1>(x, x16, ldx, sx, ldsx, w, sz, K, G, y, ldy, t);
}

using TileRange = void (*)(const uint16_t*, const uint16_t*, int64_t, const float*, int64_t, const uint8_t*,
                           const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int64_t, int64_t);
// Rows per block: 8 (two tiles at a time); one row takes eight tiles at a time (a batch-1 step).
constexpr int kRowBlock = 8;
template <int Bits, int... I>
constexpr auto make_ranges(std::integer_sequence<int, I...>) {
  return std::array<TileRange, kRowBlock>{tile_range<Bits, I + 1, (I == 0 ? 8 : 2)>...};
}
constexpr auto kRanges4 = make_ranges<4>(std::make_integer_sequence<int, kRowBlock>{});
constexpr auto kRanges8 = make_ranges<8>(std::make_integer_sequence<int, kRowBlock>{});

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

at::Tensor mm_tiles(const at::Tensor& x, const at::Tensor& codes, int64_t group_size, const at::Tensor& scales_zeros,
                    int bits) {
  const char* op = bits == 4 ? "int4_mm_tiles" : "int8_mm_tiles";
  const int64_t kc = bits == 4 ? 8 : 4;
  TORCH_CHECK(supported(), "warmserve::", op, " needs AVX512-BF16, which this CPU lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a 2-D bf16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK(G > 0 && G % 8 == 0 && K % G == 0, "group_size ", G, " must be a multiple of 8 dividing K = ", K);
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
  const auto& ranges = bits == 4 ? kRanges4 : kRanges8;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t block = std::min<int64_t>(M, kRowBlock);
    std::vector<float> sx(static_cast<size_t>(block * groups));
    std::vector<uint16_t> x16(bits == 8 ? static_cast<size_t>(block * K) : 0);
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t rows = std::min<int64_t>(kRowBlock, M - m0);
      group_sums(xp + m0 * K, rows, K, G, sx.data());
      if (bits == 8) times16(xp + m0 * K, rows * K, x16.data());
      ranges[rows - 1](xp + m0 * K, x16.data(), K, sx.data(), groups, wp, szp, K, G, yp + m0 * N, N, begin, end);
    }
  });
  return y;
}

at::Tensor int4_mm_tiles(const at::Tensor& x, const at::Tensor& codes, int64_t group_size,
                         const at::Tensor& scales_zeros) {
  return mm_tiles(x, codes, group_size, scales_zeros, 4);
}

at::Tensor int8_mm_tiles(const at::Tensor& x, const at::Tensor& codes, int64_t group_size, const at::Tensor& scales) {
  return mm_tiles(x, codes, group_size, scales, 8);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(warmserve, m) {
  m.def("int4_mm_tiles(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor");
  m.def("int8_mm_tiles(Tensor x, Tensor tiles, int group_size, Tensor scales_zeros) -> Tensor");
  m.def("int4_tiles_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(warmserve, CPU, m) {
  m.impl("int4_mm_tiles", &int4_mm_tiles);
  m.impl("int8_mm_tiles", &int8_mm_tiles);
}
