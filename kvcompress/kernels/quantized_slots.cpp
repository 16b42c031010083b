// Slots to codes and back (kvcompress/quantization.py's grid: x = minimum + code * scale per group of channels,
// float16 scale and minimum, 8-bit codes or two 4-bit codes a byte, low nibble first), exactly as the torch
// definition there computes them, in one pass on torch's threads: the same arithmetic in torch ran as a chain of
// small operations over the layer (six to read it back, about twenty to quantize a decode step's slot) and took
// most of a quantized cache's extra time per decode step.
//
// dequantize_slots writes the first `slots` slots into `out` (..., T, d) in the model's dtype; quantize_slots
// returns the codes, scales and minimums of `tensor` (..., T, d).
//
// Layouts: codes (..., S, d * bits / 8) uint8, scales and minimums (..., S, groups) float16, all contiguous, with
// S >= slots; out (..., T, d) contiguous, T >= slots; the leading dimensions (...) equal.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "quantized_slots.h"

namespace {

template <typename T>
void dequantize_rows(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, int64_t bits,
                     int64_t outer, int64_t slots, int64_t stored, int64_t dim, int64_t groups, T* out,
                     int64_t out_slots) {
  const int64_t bytes = dim * bits / 8;
  at::parallel_for(0, outer * slots, 64, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end;) {  // runs of slots within one of the leading dimensions
      const int64_t o = index / slots, t = index % slots, count = std::min(end - index, slots - t);
      const int64_t slot = o * stored + t;
      dequantize_run_as(codes + slot * bytes, scales + slot * groups, minimums + slot * groups, bits, dim, groups,
                        count, bytes, groups, out + (o * out_slots + t) * dim);
      index += count;
    }
  });
}

template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t dim, int64_t groups, int64_t bits, uint8_t* codes,
                   at::Half* scales, at::Half* minimums) {
  const int64_t group = dim / groups, bytes = dim * bits / 8;
  const float top = static_cast<float>((1 << bits) - 1);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      for (int64_t g = 0; g < groups; ++g) {
        float low = static_cast<float>(xr[g * group]), high = low;
        for (int64_t c = 1; c < group; ++c) {
          const float v = static_cast<float>(xr[g * group + c]);
          low = std::min(low, v);
          high = std::max(high, v);
        }
        const at::Half low_half(low);
        const float stored_low = static_cast<float>(low_half);
        const at::Half scale_half((high - stored_low) / top);
        float scale = static_cast<float>(scale_half);
        scale = scale > 0.0f ? scale : 1.0f;
        scales[r * groups + g] = at::Half(scale);
        minimums[r * groups + g] = low_half;
        for (int64_t c = 0; c < group; ++c) {
          const float code = std::nearbyint((static_cast<float>(xr[g * group + c]) - stored_low) / scale);
          row[g * group + c] = static_cast<uint8_t>(std::min(std::max(code, 0.0f), top));
        }
      }
      uint8_t* out = codes + r * bytes;
      if (bits == 8) {
        std::copy(row.begin(), row.end(), out);
      } else {
        for (int64_t c = 0; c < dim / 2; ++c) out[c] = row[2 * c] | (row[2 * c + 1] << 4);
      }
    }
  });
}

}  // namespace

std::vector<torch::Tensor> quantize_slots(torch::Tensor tensor, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantize_slots: 8 or 4 bits");
  TORCH_CHECK(tensor.is_contiguous(), "quantize_slots: a contiguous tensor");
  const int64_t dim = tensor.size(-1), groups = dim / group_size, rows = tensor.numel() / dim;
  TORCH_CHECK(dim % group_size == 0 && (bits == 8 || group_size % 2 == 0), "quantize_slots: groups do not fit");
  std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  shape.back() = dim * bits / 8;
  torch::Tensor codes = torch::empty(shape, tensor.options().dtype(at::kByte));
  shape.back() = groups;
  torch::Tensor scales = torch::empty(shape, tensor.options().dtype(at::kHalf));
  torch::Tensor minimums = torch::empty(shape, tensor.options().dtype(at::kHalf));
  auto run = [&](auto* x) {
    quantize_rows(x, rows, dim, groups, bits, codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                  minimums.data_ptr<at::Half>());
  };
  if (tensor.scalar_type() == at::kBFloat16) {
    run(tensor.data_ptr<at::BFloat16>());
  } else if (tensor.scalar_type() == at::kHalf) {
    run(tensor.data_ptr<at::Half>());
  } else {
    TORCH_CHECK(tensor.scalar_type() == at::kFloat, "quantize_slots: float32, bfloat16 or float16 input");
    run(tensor.data_ptr<float>());
  }
  return {codes, scales, minimums};
}

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
