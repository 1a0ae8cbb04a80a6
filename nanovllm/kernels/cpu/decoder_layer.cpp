// decoder_layer: one pre-norm decoder layer of the Llama family (Llama, Qwen2's q/k/v bias,
// Qwen3's per-head q/k norm) in bf16, as one call: the kernels the eager layer calls one by one
// (norms, linears, the KV store, paged attention, gated SiLU), in the same order on the same
// tensors, with RoPE here rounding as the eager torch ops do, so the output is eager's bit for
// bit. A decode step then crosses from Python into C++ once a layer instead of a dozen times,
// and none of the layer's glue (splits, views, RoPE) runs as Python or Inductor wrapper code.

#include "ops.h"
#include "simd.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

namespace nanovllm_cpu {
namespace {

using c10::BFloat16;
using Weights = c10::List<std::optional<at::Tensor>>;

// Four entries of `weights` from `first` (weight, packed, oneDNN copy, bias): a GGUF block
// weight where `kind` is its GGML type id, else the packed bf16 method's tensors.
at::Tensor apply_linear(const at::Tensor& x, const Weights& weights, int64_t first, int64_t kind, int64_t max_rows) {
  const at::Tensor weight = weights.get(first).value();
  const std::optional<at::Tensor> packed = weights.get(first + 1), onednn = weights.get(first + 2),
                                  bias = weights.get(first + 3);
  if (kind >= 0) return gguf_linear(x, weight, kind, bias, max_rows);
  return linear(x, weight, packed, bias, max_rows, onednn);
}

// dst[t, h] = NeoX rotation of src row t's head h by the fp32 cos|sin row of positions[t]:
// (a, b) -> (a cos - b sin, b cos + a sin), each product rounded on its own as eager's fp32 ops.
void rotate_heads(const BFloat16* src, int64_t src_stride, BFloat16* dst, int64_t T, int64_t heads, int64_t D,
                  const at::Tensor& cos_sin, const int64_t* positions) {
  using namespace simd;
  const float* cache = cos_sin.data_ptr<float>();
  const int64_t half = D / 2, max_position = cos_sin.size(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      TORCH_CHECK(positions[t] >= 0 && positions[t] < max_position, "position ", positions[t], " is outside the "
                  "RoPE cache of ", max_position);
      const float* cos = cache + positions[t] * D;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; h++) {
        const BFloat16* x = src + t * src_stride + h * D;
        BFloat16* out = dst + (t * heads + h) * D;
        for (int64_t i = 0; i < half; i += 16) {
          const int64_t n = std::min<int64_t>(16, half - i);
          const Vec a = load_bf16(x + i, n), b = load_bf16(x + half + i, n);
          const Vec c = load_first(cos + i, n, 0.0f), s = load_first(sin + i, n, 0.0f);
          store_bf16(out + i, sub(rounded(mul(a, c)), rounded(mul(b, s))), n);
          store_bf16(out + half + i, add(rounded(mul(b, c)), rounded(mul(a, s))), n);
        }
      }
    }
  });
}

at::Tensor rotated(const at::Tensor& heads, const at::Tensor& cos_sin, const at::Tensor& positions) {
  // heads: [T, H, D], each row of heads contiguous (a slice of the qkv rows, or a norm's output).
  const int64_t T = heads.size(0), H = heads.size(1), D = heads.size(2);
  TORCH_CHECK(heads.stride(2) == 1 && heads.stride(1) == D, "rotated: each token's heads must be contiguous");
  at::Tensor out = at::empty({T, H, D}, heads.options());
  rotate_heads(heads.data_ptr<BFloat16>(), heads.stride(0), out.data_ptr<BFloat16>(), T, H, D, cos_sin,
               positions.data_ptr<int64_t>());
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& positions, const Weights& weights,
    at::IntArrayRef settings, double eps, double scale, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens,
    const at::Tensor& block_tables) {
  // weights: input norm, post-attention norm, RoPE's cos|sin cache, q norm, k norm (the last two
  // None unless Qwen3), then four entries a linear for qkv, o, gate_up, down. settings: heads, KV
  // heads, head dim, then each linear's kind and row threshold (see apply_linear).
  TORCH_CHECK(weights.size() == 21 && settings.size() == 11, "decoder_layer: 21 weights and 11 settings");
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2, "decoder_layer: bf16 hidden [T, width]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == hidden.size(0), "decoder_layer: int64 positions, one a token");
  const int64_t H = settings[0], KVH = settings[1], D = settings[2], T = hidden.size(0);
  const at::Tensor cos_sin = weights.get(2).value();
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == D,
              "decoder_layer: an fp32 [positions, head_dim] cos|sin cache");

  auto [normed, summed] = add_rms_norm(hidden, residual, weights.get(0).value(), eps);
  const at::Tensor qkv = apply_linear(normed, weights, 5, settings[3], settings[7]);
  at::Tensor q = qkv.slice(1, 0, H * D).view({T, H, D});
  at::Tensor k = qkv.slice(1, H * D, (H + KVH) * D).view({T, KVH, D});
  const at::Tensor v = qkv.slice(1, (H + KVH) * D, (H + 2 * KVH) * D).view({T, KVH, D});
  const std::optional<at::Tensor> q_norm = weights.get(3), k_norm = weights.get(4);
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps);
    k = rms_norm(k, k_norm.value(), eps);
  }
  q = rotated(q, cos_sin, positions);
  k = rotated(k, cos_sin, positions);

  store_kv(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor attended = at::empty_like(q);
  paged_attention(attended, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale);

  const at::Tensor projected = apply_linear(attended.view({T, H * D}), weights, 9, settings[4], settings[8]);
  auto [mlp_in, stream] = add_rms_norm(projected, summed, weights.get(1).value(), eps);
  const at::Tensor gated = silu_and_mul(apply_linear(mlp_in, weights, 13, settings[5], settings[9]));
  return {apply_linear(gated, weights, 17, settings[6], settings[10]), stream};
}

}  // namespace nanovllm_cpu
