"""The Triton KV-store and paged-attention kernels against the portable backend, on random
paged inputs: shuffled block tables, decodes, whole prompts and chunks after a cached prefix,
GQA groups, block sizes 16 and 32, head dims that are not powers of two.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 before triton is first imported), with tiny shapes. On CUDA the same
tests run compiled, plus bigger shapes and bf16. Skipped when triton is not installed.
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import freed_behind_window, triton_skip_reason

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"

if triton_skip_reason():
    pytest.skip(triton_skip_reason(), allow_module_level=True)

from nanovllm.attention.base import BatchLayout  # noqa: E402
from nanovllm.attention.torch_native import TorchNativeBackend  # noqa: E402
from nanovllm.attention.triton import (MAX_KV_SPLITS, TritonBackend, kv_splits, paged_attention,  # noqa: E402
                                      store_kvcache)

# (context_len, query_len) per sequence: decodes, whole prompts, chunks after a cached prefix,
# lengths on and around block boundaries, and spans of several key and query tiles.
MIXED = [(1, 1), (37, 37), (50, 1), (70, 20), (32, 32), (129, 1), (100, 67), (16, 1), (17, 2)]
DECODES = [(1, 1), (16, 1), (17, 1), (65, 1), (130, 1)]
# (num_heads, num_kv_heads, head_dim): MHA, GQA 2 and 3 (a non-power-of-two group), MQA.
HEADS = [(4, 4, 16), (4, 2, 24), (6, 2, 16), (8, 1, 32)]


def paged_inputs(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """A random step over a random paged cache: returns (q, k, v, k_cache, v_cache, layout).

    Each sequence's blocks are drawn from a shuffled pool, so tables are neither contiguous
    nor ordered; its cached prefix (context_len - query_len tokens) is already in the cache.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 3  # spare blocks: some of the cache belongs to no one
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_tables = torch.full((len(seqs), max(blocks_needed)), -1, dtype=torch.int32)
    slots = []
    for i, ((ctx, q_len), n) in enumerate(zip(seqs, blocks_needed)):
        table = [pool.pop() for _ in range(n)]
        block_tables[i, :n] = torch.tensor(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    num_tokens = sum(q for _, q in seqs)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*cache_shape), randn(*cache_shape)
    q, k, v = randn(num_tokens, num_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim), \
        randn(num_tokens, num_kv_heads, head_dim)
    query_lens = [q_len for _, q_len in seqs]
    cu_seqlens = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(query_lens).cumsum(0)
    layout = BatchLayout(
        query_lens=query_lens,
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=cu_seqlens.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(query_lens),
        max_context_len=max(ctx for ctx, _ in seqs),
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k), to(v), to(k_cache), to(v_cache), layout


def run_both(q, k, v, k_cache, v_cache, layout, num_heads, num_kv_heads, head_dim, block_size, window=0, softcap=0.0):
    """(output, k_cache, v_cache) from the portable backend and from Triton, each on its own cache copy."""
    results = []
    for backend_cls in (TorchNativeBackend, TritonBackend):
        backend = backend_cls(num_heads, num_kv_heads, head_dim, block_size)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = backend.forward(q, k, v, kc, vc, backend.prepare(layout), head_dim ** -0.5, window, softcap)
        results.append((out, kc, vc))
    return results


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_matches_portable_backend(seqs, heads, block_size):
    inputs = paged_inputs(seqs, *heads, block_size)
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = run_both(*inputs, *heads, block_size)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", [(7, 0.0), (33, 0.0), (0, 2.0), (20, 1.5)])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_windowed_and_capped_attention_matches_portable_backend(seqs, window, softcap):
    """With the blocks behind each window freed (-1 in the tables), as the block manager frees
    them where every layer slides."""
    heads = (4, 2, 24)
    *tensors, layout = paged_inputs(seqs, *heads, 16)
    if window:
        layout = freed_behind_window(layout, window, 16)
    (ref, _, _), (out, _, _) = run_both(*tensors, layout, *heads, 16, window, softcap)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("heads", [(4, 2, 24), (8, 1, 32)], ids=lambda h: "h{}-kv{}-d{}".format(*h))
def test_decode_split_over_the_keys_matches(heads, splits):
    """Flash-decoding: each context in `splits` parts (some empty for the short ones, a padded
    lane with none), merged; the same output as one program over all keys."""
    num_heads, num_kv_heads, head_dim = heads
    seqs = [(1, 1), (40, 1), (130, 1), (300, 1)]
    q, k, v, k_cache, v_cache, layout = paged_inputs(seqs, *heads, 16)
    ref, _, _ = run_both(q, k, v, k_cache, v_cache, layout, *heads, 16)[0]
    backend = TritonBackend(*heads, 16)
    backend.forward(q, k, v, k_cache, v_cache, backend.prepare(layout), head_dim ** -0.5, 0, 0.0)  # stores the new K/V
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, out, layout.cu_seqlens_q, layout.context_lens, layout.block_tables,
                    1, head_dim ** -0.5, layout.max_context_len, splits=splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_kv_splits_fill_the_gpu_only_for_few_decodes():
    h200 = 132  # multiprocessors
    assert kv_splits(1, 8, 1, 40960, h200) == MAX_KV_SPLITS
    assert kv_splits(64, 8, 1, 40960, h200) == 1  # 512 programs already
    assert kv_splits(4, 8, 1, 40960, h200) == 9
    assert kv_splits(4, 8, 1, 40960, 66) == 5  # half the multiprocessors, about half the parts
    assert kv_splits(1, 8, 1, 100, h200) == 2  # no more parts than key tiles
    assert kv_splits(1, 8, 20, 40960, h200) == 1  # prefill tiles are many already


def test_non_contiguous_kv_and_padded_lanes():
    """k/v as column slices of one qkv tensor (as the model produces them); a lane with slot
    -1 and context 0 (CUDA-graph padding) writes nowhere and outputs zeros."""
    heads, head_dim, block_size = (4, 2), 16, 16
    q, k, v, k_cache, v_cache, layout = paged_inputs([(20, 3), (9, 1)], *heads, head_dim, block_size)
    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    q, k, v = (t.view(t.shape[0], -1, head_dim) for t in qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], 1))
    assert not k.is_contiguous()
    (ref, ref_k, _), _ = run_both(q, k, v, k_cache, v_cache, layout, *heads, head_dim, block_size)

    pad = lambda t, value: torch.cat([t, torch.full_like(t[:1], value)])  # noqa: E731
    padded = BatchLayout(layout.query_lens + [1], pad(layout.context_lens, 0),
                         pad(layout.cu_seqlens_q, layout.cu_seqlens_q[-1] + 1), pad(layout.slot_mapping, -1),
                         torch.cat([layout.block_tables, torch.zeros_like(layout.block_tables[:1])]), 3, 20)
    q, k, v = (torch.cat([t, torch.randn_like(t[:1])]) for t in (q, k, v))
    backend = TritonBackend(*heads, head_dim, block_size)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, kc, vc, backend.prepare(padded), head_dim ** -0.5, 0, 0.0)
    assert torch.equal(kc, ref_k)  # the padded lane's k/v went nowhere
    torch.testing.assert_close(out[:-1], ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_store_kvcache_writes_only_given_slots():
    # The caches sit inside larger buffers, so a write to slot -1 (just before block 0) would show.
    k_buffer = torch.zeros(5, 4, 2, 8, device=DEVICE)
    v_buffer = torch.zeros_like(k_buffer)
    k_cache, v_cache = k_buffer[1:4], v_buffer[1:4]
    k = torch.randn(3, 2, 8, device=DEVICE)
    v = torch.randn(3, 2, 8, device=DEVICE)
    store_kvcache(k, v, k_cache, v_cache, torch.tensor([9, -1, 2], device=DEVICE))
    expected = torch.zeros_like(k_buffer).view(-1, 2, 8)
    expected[4 + 9], expected[4 + 2] = k[0], k[2]
    assert torch.equal(k_buffer.view(-1, 2, 8), expected)
    assert torch.equal(v_cache.view(-1, 2, 8)[9], v[0]) and v_buffer.count_nonzero() == 2 * 16


@pytest.mark.skipif(ON_CUDA, reason="on CUDA the tests here compile the kernels for the device itself")
def test_kernels_compile_for_hopper():
    """The interpreter does not compile: check separately that Triton compiles the kernels to
    an sm_90 cubin, with the parameters the engine launches (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "scripts/triton_compile_check.py", "--arch", "90"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    # Per shape: the store, decode, split decode, prefill, windowed and capped prefill, and merge
    # kernels; then the three elementwise kernels in two dtypes.
    assert result.stdout.count("cubin") == 5 * 6 + 3 * 2 and "OVER" not in result.stdout


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA: larger shapes and bf16 run compiled only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("heads", [(16, 8, 128), (32, 4, 64), (14, 2, 64)], ids=lambda h: "h{}-kv{}-d{}".format(*h))
def test_large_random_batches_on_cuda(heads, block_size, dtype):
    rng = random.Random(block_size)
    seqs = [(ctx, rng.choice([1, 1, ctx, rng.randint(1, ctx)]))
            for ctx in (rng.randint(1, 3000) for _ in range(24))]
    inputs = paged_inputs(seqs, *heads, block_size, dtype=dtype, seed=block_size)
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = run_both(*inputs, *heads, block_size)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_engine_gives_the_portable_backends_tokens(tiny_checkpoint, monkeypatch):
    """Whole engine, Triton attention: chunked prompts mixed with decodes, a shared prefix
    served from the prefix cache, GQA 3; greedy tokens as with the portable backend."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.attention.selector import BACKEND_ENV

    path = tiny_checkpoint("LlamaForCausalLM", hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                           num_hidden_layers=1)  # one layer: the interpreter is slow
    rng = random.Random(2)
    prefix = [rng.randrange(300) for _ in range(33)]
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (1, 40)] + [prefix, prefix + [7, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch_native", "triton"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=48, max_num_batched_tokens=24)
        assert type(llm.llm_engine.executor.backend) is {"torch_native": TorchNativeBackend,
                                                            "triton": TritonBackend}[backend]
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.get_metrics()["prefix_cache_hit_tokens"] > 0
    assert tokens["triton"] == tokens["torch_native"]
