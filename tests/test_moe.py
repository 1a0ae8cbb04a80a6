"""Mixtures of experts end to end beyond the families' parity tests (test_models, test_engine,
test_gguf, test_tp): a GGUF file whose experts stay in their blocks runs on the CPU's MoE kernel,
with a request's tokens independent of its batch, its chunking and the prefix cache (the router
included); the same file dequantized stays close; routers the engine does not run are named."""

import pytest
import torch

from conftest import convert_as_llama_cpp, family_config, make_tiny_checkpoint, make_tiny_config
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.models.registry import get_model_class

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
TARGET = [(7 * i + 3) % 300 + 10 for i in range(70)]


def expert_types(name: str, array) -> str | None:
    """Every matrix in blocks as a llama.cpp file keeps them (the router in F32): experts' gate/up in
    Q8_0, down in Q4_0, the rest Q8_0."""
    if "ffn_gate_inp" in name:
        return None
    return "Q4_0" if "ffn_down_exps" in name else "Q8_0"


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("moe")
    arch, overrides = family_config("qwen3-moe", None, moe_intermediate_size=64)
    hf = make_tiny_checkpoint(directory / "hf", arch, max_position_embeddings=512, **overrides)
    return convert_as_llama_cpp(hf, directory / "moe.gguf", expert_types)


def tokens(llm: LLM, prompts, params=GREEDY):
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, params,
                                                                                               use_tqdm=False)]


@pytest.mark.skipif(not cpu_kernels.has_simd_kernels(), reason="needs the avx2 or avx512 CPU kernels")
def test_experts_in_blocks_give_a_request_the_same_tokens_whatever_its_batch(moe_gguf):
    from nanovllm.layers.quantization.cpu_gguf_moe import CPUGGUFMoEMethod

    settings = dict(num_kvcache_blocks=96, max_model_len=256)
    plain = LLM(moe_gguf, enable_prefix_caching=False, **settings)
    model = plain.llm_engine.executor.model
    methods = {type(layer.mlp.experts.moe_method) for layer in model.model.layers}
    assert methods == {CPUGGUFMoEMethod}
    alone = tokens(plain, [TARGET])[0]
    others = [[(11 * j + 5 * i) % 300 + 10 for i in range(5 + 9 * j)] for j in range(15)]
    assert tokens(plain, others[:7] + [TARGET] + others[7:])[7] == alone
    chunked = LLM(moe_gguf, enable_prefix_caching=False, max_num_batched_tokens=32, **settings)
    assert tokens(chunked, [TARGET])[0] == alone
    cached = LLM(moe_gguf, enable_prefix_caching=True, **settings)
    tokens(cached, [TARGET[:40] + [9, 9, 9]])
    assert tokens(cached, [TARGET])[0] == alone
    assert cached.llm_engine.get_metrics()["prefix_cache_hit_tokens"] == 32
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=0)
    assert tokens(plain, [TARGET], seeded) == tokens(chunked, [TARGET], seeded)


def test_experts_in_blocks_stay_close_to_the_same_file_dequantized(moe_gguf):
    """fp32 on both sides: the blocks' products differ from the dequantized weights' by x's 16-bit
    rounding only."""
    blocks = LLM(moe_gguf, dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    dense = LLM(moe_gguf, dtype="float32", quantization="dense", num_kvcache_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ours, reference = (llm.generate([TARGET], params, use_tqdm=False)[0].prompt_logprobs[1:] for llm in (blocks, dense))
    ours = torch.tensor([next(iter(p.values())).logprob for p in ours])
    reference = torch.tensor([next(iter(p.values())).logprob for p in reference])
    torch.testing.assert_close(ours, reference, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("overrides,message", [
    (dict(n_group=8, topk_group=4), "n_group=8: grouped top-k routing"),
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid': a router scoring function other than softmax"),
])
def test_a_router_the_engine_does_not_run_is_named(overrides, message):
    config = make_tiny_config("Qwen3MoeForCausalLM", **family_config("qwen3-moe", None)[1])
    for field, value in overrides.items():
        setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        get_model_class(config).describe(config)


def test_deepseek_names_its_router():
    config = make_tiny_config("Qwen3ForCausalLM")
    config.architectures = ["DeepseekV3ForCausalLM"]
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM: its mixture-of-experts router .*grouped top-k"):
        get_model_class(config)


def test_the_kv_budget_sets_aside_a_steps_routing_buffers(tmp_path, monkeypatch):
    """On CPU the cache takes a share of the free RAM left once the largest layer's step buffers
    are set aside: a mixture of experts' grouped rows, gate/up, activation and fp32 down rows."""
    import os

    from nanovllm.distributed.parallel_state import SINGLE
    from nanovllm.platforms import KV_CACHE_RAM_SHARE, Platform

    arch, overrides = family_config("qwen3-moe", None)
    config = make_tiny_config(arch, **overrides)
    model = get_model_class(config)(config, SINGLE)
    experts = model.model.layers[0].mlp.experts
    # hidden 64 (fp32 rows and fp32 down rows), 3 x intermediate 32, indices; 2 experts a token.
    assert experts.step_buffer_bytes(1000) == 1000 * 2 * (64 * 8 + 3 * 32 * 4 + 32)
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}[name])
    settings = type("Config", (), {"max_num_batched_tokens": 1000})()
    budget = Platform(torch.device("cpu"), torch.float32, True, SINGLE).kv_cache_budget_bytes(model, [], None, settings)
    assert budget == int(((1 << 32) - experts.step_buffer_bytes(1000)) * KV_CACHE_RAM_SHARE)
