// Slots of kvcompress/quantization.py's grid back into float32: x = minimum + code * scale per group of channels
// (float16 scale and minimum; 8-bit codes, or two 4-bit codes a byte, low nibble first). Shared by the read-back
// of whole layers (quantized_slots.cpp) and the attention kernel, which dequantizes the slots it reads as it reads
// them (fused_attention.cpp), so that both give the values torch's definition gives.

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// each product and sum rounded on its own, as torch computes them (no fused multiply-add): the tests compare the
// compiled and the torch paths exactly
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace quantized_slots {

// Codes [0, n) of a group as floats (n: the vector's lanes) times s plus m, into y: AVX-512 or AVX2 where the
// build has them (4-bit codes: each byte twice, then each lane shifted by 0 or 4 bits); without them, none
// (every channel one by one, dequantize_run's tail).
// Left to the compiler, loops of a group's length (known only at run time) ran at a fifth of this speed with
// 4-bit codes.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
inline void dequantize_lanes(const uint8_t* code, int64_t bits, float s, float m, float* y) {
  __m512i ints;
  if (bits == 8) {
    ints = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
  } else {
    const __m128i pairs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(code));
    const __m512i twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(pairs, pairs));
    const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    ints = _mm512_and_si512(_mm512_srlv_epi32(twice, shifts), _mm512_set1_epi32(0x0F));
  }
  _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(s)), _mm512_set1_ps(m)));
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
inline void dequantize_lanes(const uint8_t* code, int64_t bits, float s, float m, float* y) {
  __m256i ints;
  if (bits == 8) {
    ints = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  } else {
    int32_t word;
    std::memcpy(&word, code, 4);
    const __m128i pairs = _mm_cvtsi32_si128(word);
    const __m256i twice = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(pairs, pairs));
    const __m256i shifts = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
    ints = _mm256_and_si256(_mm256_srlv_epi32(twice, shifts), _mm256_set1_epi32(0x0F));
  }
  _mm256_storeu_ps(y, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(s)), _mm256_set1_ps(m)));
}
#else
constexpr int64_t kLanes = 0;
#endif

}  // namespace quantized_slots

// `count` consecutive slots, each `dim` channels in `groups` groups, into y (count x dim): slot r's codes at
// code + r * code_stride, its scales and minimums at scale + r * scale_stride.
inline void dequantize_run(const uint8_t* code, const at::Half* scale, const at::Half* minimum, int64_t bits,
                           int64_t dim, int64_t groups, int64_t count, int64_t code_stride, int64_t scale_stride,
                           float* y) {
  using quantized_slots::kLanes;
  const int64_t group = dim / groups;
  const int64_t whole = kLanes == 0 ? 0 : group - group % std::max<int64_t>(kLanes, 1);  // whole vectors of it
  for (int64_t r = 0; r < count; ++r, code += code_stride, scale += scale_stride, minimum += scale_stride,
               y += dim) {
    for (int64_t g = 0; g < groups; ++g) {
      const float s = static_cast<float>(scale[g]), m = static_cast<float>(minimum[g]);
      float* yg = y + g * group;
#if defined(__AVX2__) || defined(__AVX512F__)
      for (int64_t c = 0; c < whole; c += kLanes) {
        quantized_slots::dequantize_lanes(code + (g * group + c) * bits / 8, bits, s, m, yg + c);
      }
#endif
      for (int64_t c = whole; c < group; ++c) {  // the group's last channels, one by one
        const int64_t at = g * group + c;
        const int value = bits == 8 ? code[at] : (code[at / 2] >> (4 * (at % 2))) & 0x0F;
        yg[c] = static_cast<float>(value) * s + m;
      }
    }
  }
}

#pragma GCC pop_options

// The same slots into `out` in T: float32 in place, else through a float32 buffer of the thread's, narrowed in one
// vectorised pass.
template <typename T>
void dequantize_run_as(const uint8_t* code, const at::Half* scale, const at::Half* minimum, int64_t bits, int64_t dim,
                       int64_t groups, int64_t count, int64_t code_stride, int64_t scale_stride, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    dequantize_run(code, scale, minimum, bits, dim, groups, count, code_stride, scale_stride, out);
  } else {
    thread_local std::vector<float> rows;
    if (rows.size() < static_cast<size_t>(count * dim)) rows.resize(count * dim);
    dequantize_run(code, scale, minimum, bits, dim, groups, count, code_stride, scale_stride, rows.data());
    at::vec::convert(rows.data(), out, count * dim);
  }
}
