"""Decoder layers as one kernel call (platforms/cpu_fused_layers.py): in bf16 on the SIMD
kernels, the layers of every family (Llama, Qwen2's q/k/v bias, Qwen3's q/k norm, Mistral's
sliding window, Gemma 2's sandwich norms, tanh GELU, softcaps and alternating windows, Gemma 3's
local and global layers, Phi-4-mini's partial rotary LongRoPE, Qwen3-MoE's and Mixtral's experts
kept in blocks beside dense layers), on packed bf16 or GGUF block weights, run fused and return the eager
layer's output bit for bit, step after step: prefill, decode and mixed steps give eager's tokens
and log-probabilities exactly. What the call cannot run stays compiled, and says why."""

import pytest
import torch

from conftest import family_config, make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.attention.base import BatchLayout, forward_context
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.platforms.cpu_compile import CompiledDecoderLayers
from nanovllm.platforms.cpu_fused_layers import FusedDecoderLayers

pytestmark = pytest.mark.skipif(not cpu_kernels.has_simd_kernels(), reason="needs the avx2 or avx512 CPU kernels")

# Prompts of unequal lengths past a block (16), so that steps mix prefill chunks and decodes.
PROMPTS = [list(range(3, 40)), list(range(100, 105)), [7] * 21 + list(range(200, 230))]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _runner(llm: LLM):
    """What runs the model's decoder layers (None: in turn)."""
    return llm.llm_engine.executor.model.model.layers.runner


def _greedy(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


FAMILIES = {
    "llama-bias": ("LlamaForCausalLM", {"attention_bias": True}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "mistral-window": family_config("mistral", 20),
    "gemma2": family_config("gemma2", 20),
    "gemma3": family_config("gemma3", 20),
    "phi4-mini": family_config("phi4-mini", None, original_context=32),  # prompts reach the long factors
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quantization", [None, "q4_0", "q8_0"])
def test_fused_steps_equal_eager(tmp_path, family, quantization):
    arch, extra = FAMILIES[family]
    path = make_tiny_checkpoint(tmp_path, arch, **extra)
    settings = dict(dtype="bfloat16", num_kvcache_blocks=32, max_num_batched_tokens=48, quantization=quantization)
    fused, eager = LLM(str(path), **settings), LLM(str(path), enforce_eager=True, **settings)
    assert type(_runner(fused)) is FusedDecoderLayers and _runner(eager) is None
    assert _greedy(fused) == _greedy(eager)


MOE_FAMILIES = {
    "qwen3-moe-a-dense-layer": family_config("qwen3-moe", None, mlp_only_layers=[1]),
    "mixtral-window": family_config("mixtral", 20),
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("quantization", [None, "q4_0", "q8_0"])
def test_fused_experts_equal_eager(tmp_path, family, quantization):
    """The router (packed bf16 at every step), its ATen top-k and the experts' kernel (packed bf16
    experts, or in blocks) in the call."""
    arch, extra = MOE_FAMILIES[family]
    path = make_tiny_checkpoint(tmp_path, arch, **extra)
    settings = dict(dtype="bfloat16", num_kvcache_blocks=32, max_num_batched_tokens=48, quantization=quantization)
    fused, eager = LLM(str(path), **settings), LLM(str(path), enforce_eager=True, **settings)
    assert type(_runner(fused)) is FusedDecoderLayers
    assert _greedy(fused) == _greedy(eager)


def test_a_shared_expert_stays_compiled_and_says_why(tmp_path):
    arch, extra = family_config("qwen2-moe", None)
    llm = LLM(str(make_tiny_checkpoint(tmp_path, arch, **extra)), dtype="bfloat16", num_kvcache_blocks=16,
              quantization="q8_0")
    assert type(_runner(llm)) is CompiledDecoderLayers
    assert "its mixture of experts has a shared expert" in llm.llm_engine.executor.platform.layer_path


def test_fused_layers_return_the_eager_layers_output(tmp_path):
    """Layer by layer (each as a run of one) and all at once, on one prefill chunk, then one
    decode token after it."""
    llm = LLM(str(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")), dtype="bfloat16", num_kvcache_blocks=16)
    runner = llm.llm_engine.executor
    model = runner.model.model
    for start, n in ((0, 20), (20, 1)):
        layout = BatchLayout(query_lens=[n], context_lens=torch.tensor([start + n], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             slot_mapping=torch.arange(start, start + n), block_tables=torch.arange(2)[None].int(),
                             max_query_len=n, max_context_len=start + n)
        positions = torch.arange(start, start + n)
        with torch.inference_mode(), forward_context(runner.backend, runner.backend.prepare(layout)):
            hidden = model.embed_tokens(torch.arange(start + 5, start + 5 + n))
            residual = torch.zeros_like(hidden)
            first = hidden, residual
            stack = model.layers
            assert type(stack.runner) is FusedDecoderLayers
            for layer in stack:
                expected = layer(positions, hidden, residual)
                got = FusedDecoderLayers([layer])(positions, hidden, residual)
                assert all(torch.equal(e, g) for e, g in zip(expected, got))
                hidden, residual = expected
            # The whole run stores every layer's K and V again: the same values in the same slots.
            assert all(torch.equal(e, g) for e, g in zip((hidden, residual), stack(positions, *first)))


def test_fp32_layers_stay_compiled(tmp_path):
    llm = LLM(str(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")), dtype="float32", num_kvcache_blocks=16)
    assert type(_runner(llm)) is CompiledDecoderLayers
