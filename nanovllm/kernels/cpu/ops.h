// The ops the kernel files define, one file per op family; registration.cpp gives them their
// torch schemas (namespace nanovllm_cpu).

#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace nanovllm_cpu {

// linear.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed,
                  const std::optional<at::Tensor>& bias, int64_t max_packed_rows,
                  const std::optional<at::Tensor>& onednn);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features);
at::Tensor onednn_pack(const at::Tensor& weight);
void onednn_release(const at::Tensor& handle);

// quantized.cpp. The products take rows in a lanes layout (type 1000 + the file's), which
// gguf_repack makes from the file's rows; gguf_dequantize reads either. activation_bits: x's
// quantized blocks' bits, 8 or 16.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       const std::optional<at::Tensor>& bias, int64_t max_streaming_rows, int64_t activation_bits);
// A packed layer's projections in blocks of differing types: their rows one after another in
// `blocks` (1-D), parts int64 [P, 2] as (rows, type) in output order, out_features their rows
// (gguf_parts_rows: the table checked and its rows summed).
at::Tensor gguf_linear_parts(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& parts,
                             int64_t out_features, const std::optional<at::Tensor>& bias, int64_t max_streaming_rows,
                             int64_t activation_bits);
int64_t gguf_parts_rows(const at::Tensor& parts);
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t in_features);
// A file's rows in their format's lanes layout (type 1000 + theirs).
at::Tensor gguf_repack(const at::Tensor& blocks, int64_t type, int64_t in_features);

// moe.cpp: a mixture-of-experts layer's experts in blocks (w13: each expert's 2 x intermediate
// gate then up rows, w2: its hidden down rows, lanes layouts), routed by topk_ids/topk_weights
// [tokens, k]; activation 0 silu, 1 gelu_tanh.
at::Tensor gguf_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                    const at::Tensor& w13, int64_t w13_type, const at::Tensor& w2, int64_t w2_type,
                    int64_t intermediate, int64_t activation, int64_t max_streaming_rows, int64_t w13_bits,
                    int64_t w2_bits);
// The same over dense bf16 experts packed for linear_packed: w13 [E, 2I/16, H/2, 16, 2], w2 [E, H/16, I/2, 16, 2].
at::Tensor packed_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& w13, const at::Tensor& w2, int64_t intermediate, int64_t activation);

// attention.cpp
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, const at::Tensor& block_tables,
                     double scale, int64_t window, double softcap);

// sampling.cpp
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures, const at::Tensor& uniforms);
void mask_disallowed(at::Tensor& logits, const at::Tensor& bitmask);

// elementwise.cpp
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

// decoder_layer.cpp
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& hidden, const at::Tensor& residual, const at::Tensor& positions,
    const c10::List<std::optional<at::Tensor>>& weights, at::IntArrayRef settings, double eps, double scale,
    double softcap, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& cu_seqlens_q,
    const at::Tensor& context_lens, const at::Tensor& block_tables);

}  // namespace nanovllm_cpu
