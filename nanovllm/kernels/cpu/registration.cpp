// CPU kernels for the decode-heavy parts of a step, registered here as torch ops (namespace
// nanovllm_cpu) and built on first use by nanovllm/kernels/cpu.py. One file per op family:
// linear.cpp (the packed bf16 linear, oneDNN's packed weights), quantized.cpp (GGUF's block
// formats), moe.cpp (a mixture of experts' experts in blocks), attention.cpp (the paged KV cache:
// store_kv, paged_attention), sampling.cpp, elementwise.cpp (gated SiLU, RMSNorm),
// decoder_layer.cpp (runs of Llama-family layers as one call over the others); the SIMD layer
// they share, which alone knows the instruction set, is simd.h.

#include "ops.h"
#include "simd.h"

#include <torch/library.h>

#include <string>

TORCH_LIBRARY(nanovllm_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? packed, Tensor? bias, int max_packed_rows, Tensor? onednn) -> Tensor");
  m.def("onednn_pack(Tensor weight) -> Tensor");
  m.def("onednn_release(Tensor handle) -> ()");
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, Tensor? bias, int max_streaming_rows, int activation_bits=16) -> Tensor");
  m.def("gguf_linear_parts(Tensor x, Tensor blocks, Tensor parts, int out_features, Tensor? bias, int max_streaming_rows, "
        "int activation_bits=16) -> Tensor");
  m.def("gguf_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, int w13_type, Tensor w2, int w2_type, "
        "int intermediate, int activation, int max_streaming_rows, int w13_bits, int w2_bits) -> Tensor");
  m.def("packed_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, int intermediate, "
        "int activation) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int in_features) -> Tensor");
  m.def("gguf_repack(Tensor blocks, int type, int in_features) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
        "Tensor context_lens, Tensor block_tables, float scale, int window, float softcap) -> ()");
  m.def("sample_rows(Tensor logits, Tensor temperatures, Tensor uniforms) -> Tensor");
  m.def("mask_disallowed(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("decoder_layers(Tensor hidden, Tensor residual, Tensor positions, Tensor?[] weights, int[] settings, "
        "float eps, float scale, float softcap, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
        "Tensor cu_seqlens_q, Tensor context_lens, Tensor block_tables) -> (Tensor, Tensor)");
  m.def("isa() -> str", [] { return std::string(nanovllm_cpu::simd::kIsa); });
  // Whether the kernel granted this process the AMX tiles (an `amx` build without them runs its
  // many-row path on AVX-512).
  m.def("amx_tiles_granted() -> bool", [] {
#if defined(NANOVLLM_SIMD_AMX)
    return nanovllm_cpu::simd::tiles::permitted();
#else
    return false;
#endif
  });
}

TORCH_LIBRARY_IMPL(nanovllm_cpu, CPU, m) {
  m.impl("linear", &nanovllm_cpu::linear);
  m.impl("onednn_pack", &nanovllm_cpu::onednn_pack);
  m.impl("onednn_release", &nanovllm_cpu::onednn_release);
  m.impl("linear_packed", &nanovllm_cpu::linear_packed);
  m.impl("gguf_linear", &nanovllm_cpu::gguf_linear);
  m.impl("gguf_linear_parts", &nanovllm_cpu::gguf_linear_parts);
  m.impl("gguf_moe", &nanovllm_cpu::gguf_moe);
  m.impl("packed_moe", &nanovllm_cpu::packed_moe);
  m.impl("gguf_dequantize", &nanovllm_cpu::gguf_dequantize);
  m.impl("gguf_repack", &nanovllm_cpu::gguf_repack);
  m.impl("store_kv", &nanovllm_cpu::store_kv);
  m.impl("paged_attention", &nanovllm_cpu::paged_attention);
  m.impl("sample_rows", &nanovllm_cpu::sample_rows);
  m.impl("mask_disallowed", &nanovllm_cpu::mask_disallowed);
  m.impl("silu_and_mul", &nanovllm_cpu::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &nanovllm_cpu::gelu_tanh_and_mul);
  m.impl("rms_norm", &nanovllm_cpu::rms_norm);
  m.impl("add_rms_norm", &nanovllm_cpu::add_rms_norm);
  m.impl("decoder_layers", &nanovllm_cpu::decoder_layers);
}
