"""KV-cache sizing on GPUs: the warm-up step's shape, the budget arithmetic, the warm-up forward
itself (device-agnostic, so it runs here on CPU), the measured path against a fake device's
memory queries, and logits bounded by the warm-up's rows; the real measured sizing needs CUDA."""

import pytest
import torch

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.platforms.gpu_memory import kv_cache_budget, profile_kv_cache_bytes, run_warmup_step, warmup_batch

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
    # Eager: the CPU's compiled layers are specialized to the real cache, not the warm-up's
    # one-block scratch cache (on CUDA the warm-up runs before anything is compiled).
    llm = LLM(str(path), dtype="float32", device="cpu", num_kvcache_blocks=32, max_num_batched_tokens=300,
              enforce_eager=True)
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


class FakeCUDAMemory:
    """torch.cuda's memory queries on a CPU: a device of `total` bytes with `in_use` taken and a
    step that peaks at `step_peak`; records the order of the calls."""

    def __init__(self, total: int, in_use: int, step_peak: int):
        self.total, self.in_use, self.step_peak = total, in_use, step_peak
        self.calls = []
        self.cached = 5 * GiB  # the allocator's cache from earlier work, freed by empty_cache

    def empty_cache(self):
        self.calls.append("empty_cache")
        self.cached = 0

    def mem_get_info(self, device=None):
        self.calls.append("mem_get_info")
        return self.total - self.in_use - self.cached, self.total

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GiB)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1 * GiB + self.step_peak)


def test_measured_sizing_arithmetic_with_a_fake_device(tmp_path, monkeypatch):
    """The measured path on a CPU model: the cached segments of earlier work are handed back
    before free memory is read, and the budget is the utilization share less what is in use
    and the step's peak."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kvcache_blocks=32, max_num_batched_tokens=64,
              enforce_eager=True)
    runner = llm.llm_engine.executor
    fake = FakeCUDAMemory(total=80 * GiB, in_use=10 * GiB, step_peak=3 * GiB)
    fake.install(monkeypatch)
    budget = profile_kv_cache_bytes(runner.model, runner.attn_layers, runner.backend, runner.config, runner.device)
    assert budget == kv_cache_budget(80 * GiB, 70 * GiB, 3 * GiB, runner.config.gpu_memory_utilization)
    assert fake.calls[-2:] == ["empty_cache", "mem_get_info"]


def test_prompt_logprobs_logits_stay_within_the_warmed_up_rows(tmp_path, monkeypatch):
    """A step's logits never exceed the max_num_seqs rows the warm-up made, prompt logprobs
    of a prompt longer than that included."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kvcache_blocks=32, max_num_seqs=4, enforce_eager=True)
    model = llm.llm_engine.executor.model
    rows = []
    compute_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: rows.append(len(hidden)) or compute_logits(hidden))
    out = llm.generate([list(range(3, 40))], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 37 and max(rows) <= 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory-based sizing needs CUDA")
def test_cuda_cache_fills_the_utilization_share(tmp_path):
    # Blocks of 0.5-1 MB (8 layers of 8 KV heads of 128), so that half an H200 is ~10^5 of them,
    # and a cap (max_num_seqs full-length sequences) above that.
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=8, head_dim=128)
    torch.cuda.empty_cache()  # as the engine does before it measures: earlier tests' cached segments are free
    free, total = torch.cuda.mem_get_info()
    llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.5, enforce_eager=True, max_model_len=256,
              max_num_seqs=16384)
    runner = llm.llm_engine.executor
    cache_bytes = runner.num_kvcache_blocks * runner.kv_bytes_per_block
    assert runner.num_kvcache_blocks < 16384 * -(-256 // runner.block_size)  # the share, not the cap
    # The cache takes what half the device leaves, less weights and the step peak (small here).
    share = 0.5 * total - (total - free)
    assert share - 2 * GiB < cache_bytes <= share
