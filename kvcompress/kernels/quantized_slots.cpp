// Quantized slots back in full precision (kvcompress/quantization.py's grid: x = minimum + code * scale per group of
// channels, float16 scale and minimum, 8-bit codes or two 4-bit codes a byte, low nibble first), written into the
// first `slots` slots of `out` (..., T, d) in the model's dtype. One pass over the codes, on torch's threads:
// the same arithmetic in torch (unpack, widen, multiply, add, narrow, concatenate) made six passes over the layer
// and took most of a quantized cache's extra time per decode step.
//
// Layouts: codes (..., S, d * bits / 8) uint8, scales and minimums (..., S, groups) float16, all contiguous, with
// S >= slots; out (..., T, d) contiguous, T >= slots; the leading dimensions (...) equal.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>
#include <vector>

// x = minimum + code * scale rounded twice, as torch computes it (the tests compare both paths exactly)
#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
void dequantize_rows(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, int64_t bits,
                     int64_t outer, int64_t slots, int64_t stored, int64_t dim, int64_t groups, T* out,
                     int64_t out_slots) {
  const int64_t group = dim / groups, bytes = dim * bits / 8;
  at::parallel_for(0, outer * slots, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);  // a slot in float32, then narrowed in one vectorised pass
    for (int64_t index = begin; index < end; ++index) {
      const int64_t o = index / slots, t = index % slots;
      const uint8_t* code = codes + (o * stored + t) * bytes;
      const at::Half* scale = scales + (o * stored + t) * groups;
      const at::Half* minimum = minimums + (o * stored + t) * groups;
      float* y = std::is_same_v<T, float> ? reinterpret_cast<float*>(out + (o * out_slots + t) * dim) : row.data();
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
      if constexpr (!std::is_same_v<T, float>) at::vec::convert(row.data(), out + (o * out_slots + t) * dim, dim);
    }
  });
}

}  // namespace

void dequantize_slots(torch::Tensor codes, torch::Tensor scales, torch::Tensor minimums, int64_t bits,
                      int64_t slots, torch::Tensor out) {
  TORCH_CHECK(bits == 8 || bits == 4, "dequantize_slots: 8 or 4 bits");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && minimums.is_contiguous() && out.is_contiguous(),
              "dequantize_slots: contiguous tensors only");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf &&
                  minimums.scalar_type() == at::kHalf,
              "dequantize_slots: uint8 codes, float16 scales and minimums");
  const int64_t dim = out.size(-1), groups = scales.size(-1), stored = codes.size(-2), out_slots = out.size(-2);
  TORCH_CHECK(codes.size(-1) * 8 == dim * bits && dim % groups == 0 && slots <= stored && slots <= out_slots,
              "dequantize_slots: shapes do not match");
  const int64_t outer = out.numel() / (out_slots * dim);
  TORCH_CHECK(codes.numel() == outer * stored * codes.size(-1), "dequantize_slots: leading dimensions differ");
  const auto* code = codes.data_ptr<uint8_t>();
  const auto* scale = scales.data_ptr<at::Half>();
  const auto* minimum = minimums.data_ptr<at::Half>();
  if (out.scalar_type() == at::kBFloat16) {
    dequantize_rows(code, scale, minimum, bits, outer, slots, stored, dim, groups, out.data_ptr<at::BFloat16>(),
                    out_slots);
  } else if (out.scalar_type() == at::kHalf) {
    dequantize_rows(code, scale, minimum, bits, outer, slots, stored, dim, groups, out.data_ptr<at::Half>(),
                    out_slots);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kFloat, "dequantize_slots: float32, bfloat16 or float16 output");
    dequantize_rows(code, scale, minimum, bits, outer, slots, stored, dim, groups, out.data_ptr<float>(),
                    out_slots);
  }
}
