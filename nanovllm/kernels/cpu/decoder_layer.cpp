// decoder_layers: a run of pre-norm decoder layers (models/decoder.py's, as their description
// shapes them: q/k/v biases, per-head q/k norm, a sliding window per layer, an attention softcap,
// norms on the attention's and MLP's outputs too, a SiLU or tanh-GELU gate, a dense MLP or a
// mixture of experts: a router and routed experts in GGUF blocks or packed bf16) in bf16, as one call:
// for each layer in turn the kernels the eager layer calls one by one (norms, linears, the KV
// store, paged attention, the gated activation or the router's ATen ops and the experts' kernel),
// in the same order on the same tensors, with
// RoPE here rounding as the eager torch ops do, so the output is eager's bit for bit. A decode step then crosses from Python into C++ once for the
// whole model instead of a dozen times a layer, and none of the layers' glue (splits, views,
// RoPE) runs as Python or Inductor wrapper code.

#include "ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>

namespace nanovllm_cpu {
namespace {

using c10::BFloat16;
using Weights = c10::List<std::optional<at::Tensor>>;

// The layout of each layer's share of decoder_layers' arguments (platforms/cpu_fused_layers.py
// builds them; the layers' shares follow one another). weights: input norm, post-attention
// norm, pre-feedforward and post-feedforward norms (None without sandwich norms), RoPE's cos|sin
// cache, q norm, k norm (None without q/k norm), then per linear (qkv, o, gate_up, down, router)
// its weight, packed copy, oneDNN copy and bias. settings: heads, KV heads, head dim, sliding
// window (0: none), sandwich norms (0/1), activation (kSilu, kGeluTanh), the MLP's experts (0: a
// dense MLP), experts a token, whether their weights are renormalised (0/1) and an expert's
// intermediate size, then each linear's kind (a GGUF block weight's type id; kGGUFParts for one in
// parts of differing types, whose parts table takes the packed copy's place; kPackedBF16 for the
// packed bf16 method), then each one's row threshold, then each one's activation bits (a GGUF
// weight's x in 8 or 16 bits; unused by the packed bf16 method). In a mixture of experts, gate_up
// and down are every expert's (moe.cpp's w13 and w2: GGUF blocks, or packed bf16 where their kind
// is kPackedBF16); a dense layer has no router.
enum Linear { kQKV, kOut, kGateUp, kDown, kRouter, kLinears };
enum Activation { kSilu, kGeluTanh };
constexpr int64_t kLinearWeights = 7, kWeightsPerLinear = 4, kLinearSettings = 10;
constexpr int64_t kPackedBF16 = -1, kGGUFParts = -2;
constexpr int64_t kWeights = kLinearWeights + kWeightsPerLinear * kLinears, kSettings = kLinearSettings + 3 * kLinears;

// One layer's share of the weights: weight(i) is the layer's i-th in the layout above.
struct LayerWeights {
  const Weights& all;
  int64_t offset;
  std::optional<at::Tensor> weight(int64_t i) const { return all.get(offset + i); }
};

at::Tensor apply_linear(Linear which, const at::Tensor& x, const LayerWeights& weights, at::IntArrayRef settings) {
  const int64_t first = kLinearWeights + kWeightsPerLinear * which;
  const int64_t kind = settings[kLinearSettings + which], max_rows = settings[kLinearSettings + kLinears + which],
                bits = settings[kLinearSettings + 2 * kLinears + which];
  const at::Tensor weight = weights.weight(first).value();
  const std::optional<at::Tensor> packed = weights.weight(first + 1), onednn = weights.weight(first + 2),
                                  bias = weights.weight(first + 3);
  if (kind >= 0) return gguf_linear(x, weight, kind, bias, max_rows, bits);
  if (kind == kGGUFParts) {
    const at::Tensor& parts = packed.value();
    return gguf_linear_parts(x, weight, parts, gguf_parts_rows(parts), bias, max_rows, bits);
  }
  TORCH_CHECK(kind == kPackedBF16, "decoder_layers: linear kind ", kind, " is none of a GGUF type, ", kGGUFParts,
              " (GGUF parts) or ", kPackedBF16, " (packed bf16)");
  return linear(x, weight, packed, bias, max_rows, onednn);
}

// heads [T, H, D] (each token's heads contiguous: a slice of the qkv rows, or a norm's output)
// NeoX-rotated by the fp32 cos|sin row of each token's position: (a, b) -> (a cos - b sin,
// b cos + a sin), each product rounded on its own as eager's fp32 ops round it. A cache narrower
// than the head (a partial rotary embedding) rotates its first R dims; the rest pass through.
at::Tensor rotated(const at::Tensor& heads, const at::Tensor& cos_sin, const at::Tensor& positions) {
  using namespace simd;
  const int64_t T = heads.size(0), H = heads.size(1), D = heads.size(2), R = cos_sin.size(1), half = R / 2;
  TORCH_CHECK(heads.stride(2) == 1 && heads.stride(1) == D, "rotated: each token's heads must be contiguous");
  at::Tensor out = at::empty({T, H, D}, heads.options());
  const BFloat16* src = heads.data_ptr<BFloat16>();
  BFloat16* dst = out.data_ptr<BFloat16>();
  const float* cache = cos_sin.data_ptr<float>();
  const int64_t* position = positions.data_ptr<int64_t>();
  const int64_t src_stride = heads.stride(0), max_position = cos_sin.size(0);
  parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      TORCH_CHECK(position[t] >= 0 && position[t] < max_position, "position ", position[t], " is outside the "
                  "RoPE cache of ", max_position);
      const float* cos = cache + position[t] * R;
      const float* sin = cos + half;
      for (int64_t h = 0; h < H; h++) {
        const BFloat16* x = src + t * src_stride + h * D;
        BFloat16* y = dst + (t * H + h) * D;
        for (int64_t i = 0; i < half; i += 16) {
          const int64_t n = std::min<int64_t>(16, half - i);
          const Vec a = load_bf16(x + i, n), b = load_bf16(x + half + i, n);
          const Vec c = load_first(cos + i, n, 0.0f), s = load_first(sin + i, n, 0.0f);
          store_bf16(y + i, sub(rounded(mul(a, c)), rounded(mul(b, s))), n);
          store_bf16(y + half + i, add(rounded(mul(b, c)), rounded(mul(a, s))), n);
        }
        std::copy(x + R, x + D, y + R);
      }
    }
  });
  return out;
}

// A dense MLP: down(act(gate) * up).
at::Tensor mlp(const at::Tensor& x, const LayerWeights& weights, at::IntArrayRef settings) {
  const at::Tensor gate_up = apply_linear(kGateUp, x, weights, settings);
  const at::Tensor gated = settings[5] == kSilu ? silu_and_mul(gate_up) : gelu_tanh_and_mul(gate_up);
  return apply_linear(kDown, gated, weights, settings);
}

// A mixture of experts: the router's logits, then layers/fused_moe.py's `route` in the same ATen
// ops (softmax in fp32, top-k, renormalised where the family does), then the experts' kernel.
at::Tensor experts(const at::Tensor& x, const LayerWeights& weights, at::IntArrayRef settings) {
  const at::Tensor logits = apply_linear(kRouter, x, weights, settings);
  auto [top, ids] = at::topk(at::softmax(logits, -1, at::kFloat), settings[7], -1);
  if (settings[8] != 0) top = at::div(top, at::sum(top, {-1}, true));
  const auto kind = [&](Linear which) { return settings[kLinearSettings + which]; };
  const auto bits = [&](Linear which) { return settings[kLinearSettings + 2 * kLinears + which]; };
  const at::Tensor w13 = weights.weight(kLinearWeights + kWeightsPerLinear * kGateUp).value(),
                   w2 = weights.weight(kLinearWeights + kWeightsPerLinear * kDown).value();
  if (kind(kGateUp) == kPackedBF16) return packed_moe(x, ids, top, w13, w2, settings[9], settings[5]);
  return gguf_moe(x, ids, top, w13, kind(kGateUp), w2, kind(kDown), settings[9], settings[5],
                  settings[kLinearSettings + kLinears + kGateUp], bits(kGateUp), bits(kDown));
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& positions, const LayerWeights& weights,
    at::IntArrayRef settings, double eps, double scale, double softcap, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens,
    const at::Tensor& block_tables) {
  const int64_t H = settings[0], KVH = settings[1], D = settings[2], window = settings[3], T = hidden.size(0);
  const bool sandwich = settings[4] != 0;
  const int64_t activation = settings[5];
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "decoder_layers: activation ", activation,
              " is neither ", kSilu, " (SiLU) nor ", kGeluTanh, " (tanh GELU)");
  const at::Tensor cos_sin = weights.weight(4).value();
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) <= D &&
                  cos_sin.size(1) % 2 == 0, "decoder_layers: an fp32 [positions, rotary dims <= head_dim] cos|sin cache");

  auto [normed, summed] = add_rms_norm(hidden, residual, weights.weight(0).value(), eps);
  const at::Tensor qkv = apply_linear(kQKV, normed, weights, settings);
  at::Tensor q = qkv.slice(1, 0, H * D).view({T, H, D});
  at::Tensor k = qkv.slice(1, H * D, (H + KVH) * D).view({T, KVH, D});
  const at::Tensor v = qkv.slice(1, (H + KVH) * D, (H + 2 * KVH) * D).view({T, KVH, D});
  const std::optional<at::Tensor> q_norm = weights.weight(5), k_norm = weights.weight(6);
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps);
    k = rms_norm(k, k_norm.value(), eps);
  }
  q = rotated(q, cos_sin, positions);
  k = rotated(k, cos_sin, positions);

  store_kv(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor attended = at::empty_like(q);
  paged_attention(attended, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window, softcap);

  at::Tensor projected = apply_linear(kOut, attended.view({T, H * D}), weights, settings);
  if (sandwich) projected = rms_norm(projected, weights.weight(1).value(), eps);
  auto [mlp_in, stream] = add_rms_norm(projected, summed, weights.weight(sandwich ? 2 : 1).value(), eps);
  const at::Tensor down = settings[6] > 0 ? experts(mlp_in, weights, settings) : mlp(mlp_in, weights, settings);
  return {sandwich ? rms_norm(down, weights.weight(3).value(), eps) : down, stream};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& positions, const Weights& weights,
    at::IntArrayRef settings, double eps, double scale, double softcap, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& cu_seqlens_q,
    const at::Tensor& context_lens, const at::Tensor& block_tables) {
  const int64_t layers = int64_t(k_caches.size());
  TORCH_CHECK(layers > 0 && int64_t(v_caches.size()) == layers, "decoder_layers: a K and a V cache a layer");
  TORCH_CHECK(int64_t(weights.size()) == layers * kWeights && int64_t(settings.size()) == layers * kSettings,
              "decoder_layers: ", kWeights, " weights and ", kSettings, " settings a layer");
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16 && hidden.dim() == 2, "decoder_layers: bf16 hidden [T, width]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == hidden.size(0), "decoder_layers: int64 positions, one a token");
  at::Tensor h = hidden, r = residual;
  for (int64_t layer = 0; layer < layers; layer++) {
    // The caches are written in place: these handles share their storage.
    at::Tensor k_cache = k_caches[layer], v_cache = v_caches[layer];
    std::tie(h, r) = decoder_layer(h, r, positions, LayerWeights{weights, layer * kWeights},
                                   settings.slice(layer * kSettings, kSettings), eps, scale, softcap, k_cache, v_cache,
                                   slot_mapping, cu_seqlens_q, context_lens, block_tables);
  }
  return {h, r};
}

}  // namespace nanovllm_cpu
