"""KV-cache sizing on GPUs: the warm-up step's shape, the budget arithmetic, and the warm-up
forward itself (device-agnostic, so it runs here on CPU); the measured sizing needs CUDA."""

import pytest
import torch

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.engine.gpu_memory import kv_cache_budget, run_warmup_step, warmup_batch

GiB = 1 << 30


@pytest.mark.parametrize("num_tokens, max_model_len, max_num_seqs, expected", [
    (2048, 4096, 256, [2048]),  # one prompt takes the whole budget
    (2048, 1000, 256, [1000, 1000, 48]),  # prompts no longer than max_model_len
    (2048, 64, 4, [64] * 4),  # no more than max_num_seqs prompts
    (5, 64, 256, [5]),
])
def test_warmup_batch_is_the_largest_step(num_tokens, max_model_len, max_num_seqs, expected):
    input_ids, positions, layout = warmup_batch(num_tokens, max_model_len, max_num_seqs, 16, torch.device("cpu"))
    assert layout.query_lens == expected and layout.context_lens.tolist() == expected
    assert input_ids.shape == positions.shape == layout.slot_mapping.shape == (sum(expected),)
    assert layout.cu_seqlens_q.tolist()[-1] == sum(expected)
    assert positions[:expected[0]].tolist() == list(range(expected[0]))
    # Everything lives in block 0 of a one-block scratch cache.
    assert int(layout.slot_mapping.max()) < 16 and int(layout.block_tables.abs().max()) == 0
    assert layout.block_tables.shape == (len(expected), -(-max(expected) // 16))


def test_budget_honours_utilization_and_the_step_peak():
    # 80 GiB device, 10 GiB in use (weights, context), the step peaks at 3 GiB.
    assert kv_cache_budget(80 * GiB, 70 * GiB, 3 * GiB, 0.9) == int(0.9 * 80 * GiB) - 13 * GiB
    assert kv_cache_budget(80 * GiB, 70 * GiB, 3 * GiB, 0.1) == 0  # never negative: start-up then says what is missing


def test_warmup_forward_runs_and_unbinds_its_scratch_cache(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kvcache_blocks=32, max_num_batched_tokens=300)
    runner = llm.llm_engine.executor
    seen = []
    hook = runner.model.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    run_warmup_step(runner.model, runner.attn_layers, runner.backend, runner.config, runner.device)
    hook.remove()
    assert seen == [300]  # the whole token budget, as prompts of 256 (max_model_len) and 44 tokens
    assert all(layer.k_cache.numel() == 0 for layer in runner.attn_layers)
    runner._allocate_kv_cache()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory-based sizing needs CUDA")
def test_cuda_cache_fills_the_utilization_share(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    free, total = torch.cuda.mem_get_info()
    llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.5, enforce_eager=True)
    runner = llm.llm_engine.executor
    cache_bytes = runner.num_kvcache_blocks * runner.kv_bytes_per_block
    in_use_before = total - free
    # The cache takes what half the device leaves, less weights and the step peak (small here).
    assert 0.5 * total - in_use_before - 2 * GiB < cache_bytes <= 0.5 * total - in_use_before
