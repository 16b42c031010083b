// One slot of kvcompress/quantization.py's grid back into float32: x = minimum + code * scale per group of
// channels (float16 scale and minimum; 8-bit codes, or two 4-bit codes a byte, low nibble first). Shared by the
// read-back of whole layers (quantized_slots.cpp) and the attention kernel, which dequantizes the slots it reads
// as it reads them (fused_attention.cpp), so that both give the values torch's definition gives.

#pragma once

#include <c10/util/Half.h>

#include <cstdint>

// each product and sum rounded on its own, as torch computes them (no fused multiply-add): the tests compare the
// compiled and the torch paths exactly
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

inline void dequantize_slot(const uint8_t* code, const at::Half* scale, const at::Half* minimum, int64_t bits,
                            int64_t dim, int64_t groups, float* y) {
  const int64_t group = dim / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float s = static_cast<float>(scale[g]), m = static_cast<float>(minimum[g]);
    float* yg = y + g * group;
    if (bits == 8) {
      const uint8_t* cg = code + g * group;
      for (int64_t c = 0; c < group; ++c) yg[c] = static_cast<float>(cg[c]) * s + m;
    } else {
      const uint8_t* cg = code + g * group / 2;
      for (int64_t c = 0; c < group / 2; ++c) {
        yg[2 * c] = static_cast<float>(cg[c] & 0x0F) * s + m;
        yg[2 * c + 1] = static_cast<float>(cg[c] >> 4) * s + m;
      }
    }
  }
}

#pragma GCC pop_options
