"""Batch invariance on the CPU's quantized path: a request's tokens (greedy, and sampled with a
seed) and their logprobs are the same whatever else shares its steps. The same prompt alone, inside a batch of 16
prompts of mixed lengths, after a prefix-cache hit on its first blocks, and prefilled 32 tokens a
step: identical tokens and logprobs. The file mixes the block types of a Q4_K_M (Q4_K, Q6_K, Q4_0, Q8_0, Q4_1),
so every step size runs the streaming kernel (a decode alone) and the tiled one (a prefill, a
batch of 16), with x in 8 bits (q/k/v and down: K-quants only, the byte tiles) and in 16 (the
rest), and attention takes one to sixteen query rows a call."""

import pytest

from conftest import write_tiny_gguf
from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.bench_twins import TwinShape
from nanovllm.kernels import cpu as cpu_kernels

if not cpu_kernels.available():
    pytest.skip("the CPU kernels could not be built here", allow_module_level=True)

SHAPE = TwinShape("qwen3", 256, 512, 2, 4, 2, 64, 320, 10000.0, 1e-6, 256, True)
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_0", "ffn_up": "Q8_0",
         "ffn_down": "Q6_K"}
TARGET = [(7 * i + 3) % 300 + 10 for i in range(70)]  # 70 prompt tokens
PARAMS = {"greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
          "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True, logprobs=0)}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("invariance") / "mixed.gguf", SHAPE,
                           lambda name: TYPES.get(name.split(".")[-2], "Q4_1" if name.startswith("blk") else "Q8_0"))


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], float]]:
    """Each prompt's tokens and their summed logprob (the same bits only if every logit is)."""
    return [(out.outputs[0].token_ids, out.outputs[0].cumulative_logprob)
            for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", list(PARAMS))
def test_a_requests_tokens_do_not_depend_on_its_batch(model_path, kind):
    params = PARAMS[kind]
    settings = dict(num_kvcache_blocks=96, max_model_len=256)
    plain = LLM(model_path, enable_prefix_caching=False, **settings)
    alone = tokens(plain, [TARGET], params)[0]

    others = [[(11 * j + 5 * i) % 300 + 10 for i in range(5 + 9 * j)] for j in range(15)]
    batch = tokens(plain, others[:7] + [TARGET] + others[7:], params)
    assert batch[7] == alone

    chunked = LLM(model_path, enable_prefix_caching=False, max_num_batched_tokens=32, **settings)
    assert tokens(chunked, [TARGET], params)[0] == alone

    cached = LLM(model_path, enable_prefix_caching=True, **settings)
    tokens(cached, [TARGET[:40] + [9, 9, 9]], params)  # caches the target's first 32 tokens (two blocks)
    assert tokens(cached, [TARGET], params)[0] == alone
    assert cached.llm_engine.get_metrics()["prefix_cache_hit_tokens"] == 32
