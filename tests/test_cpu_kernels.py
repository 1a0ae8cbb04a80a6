"""The compiled CPU kernels against plain PyTorch on random inputs.

Attention: the CPU backend against the portable backend on random paged steps (shuffled block
tables, decodes, whole prompts, chunks after a cached prefix, GQA groups, block sizes 16 and
32, head dims on both the vectorised bf16 path and the portable one). Both caches get the same
prefix through their own backend's store; every slot no step wrote holds NaN in the CPU
backend's cache, so a kernel that read one would return NaN.

Packed linear: against F.linear in fp32 on the same bf16 inputs, for row counts in one pass,
in passes split evenly and in several row blocks, output sizes that are not multiples of 16
and an odd K.
The linear op: F.linear's bf16 result on either side of its row crossover.
The elementwise ops (gated SiLU and tanh GELU, RMSNorm): eager bf16 PyTorch, to the last bit of an exp or a sum.
The kernels' thread pool: the same bits on one thread and on several, and a forked child that
runs the kernels on a pool of its own.
"""

import gc
import os
import random
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import freed_behind_window
from nanovllm.attention.base import BatchLayout
from nanovllm.attention.torch_native import TorchNativeBackend
from nanovllm.kernels import cpu as cpu_kernels

if not cpu_kernels.available():
    pytest.skip("the CPU kernels could not be built here", allow_module_level=True)

from nanovllm.attention.cpu import CPUBackend  # noqa: E402

MIXED = [(1, 1), (37, 37), (50, 1), (70, 20), (32, 32), (129, 1), (100, 67), (16, 1), (17, 2)]
DECODES = [(1, 1), (16, 1), (17, 1), (65, 1), (130, 1), (300, 1)]
# (num_heads, num_kv_heads, head_dim): MHA, GQA 3 (SmolLM2), MQA; 64 and 128 take the
# vectorised bf16 path, 24 the portable one.
HEADS = [(4, 4, 64), (9, 3, 64), (8, 1, 128), (4, 2, 24)]


def paged_step(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A random step over a random paged cache.

    Returns (q, k, v, prefix_k, prefix_v, prefix_slots, num_blocks, layout): each sequence's
    cached prefix (context_len - query_len tokens) is given as k/v rows and the slots they
    belong in, for each backend to store in its own layout. Block tables are drawn from a
    shuffled pool, so they are neither contiguous nor ordered, and some blocks belong to no one.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_tables = torch.full((len(seqs), max(blocks_needed)), -1, dtype=torch.int32)
    slots, prefix_slots = [], []
    for i, ((ctx, q_len), n) in enumerate(zip(seqs, blocks_needed)):
        table = [pool.pop() for _ in range(n)]
        block_tables[i, :n] = torch.tensor(table)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        prefix_slots += seq_slots[:ctx - q_len]
        slots += seq_slots[ctx - q_len:]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    num_tokens = sum(q for _, q in seqs)
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    prefix_k, prefix_v = randn(len(prefix_slots), num_kv_heads, head_dim), randn(len(prefix_slots), num_kv_heads, head_dim)
    query_lens = [q_len for _, q_len in seqs]
    cu_seqlens = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(query_lens).cumsum(0)
    layout = BatchLayout(
        query_lens=query_lens,
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        cu_seqlens_q=cu_seqlens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_context_len=max(ctx for ctx, _ in seqs),
    )
    return q, k, v, prefix_k, prefix_v, torch.tensor(prefix_slots, dtype=torch.int64), num_blocks, layout


def token_major(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's caches ([KVH, blocks, bs * D], see kernels/cpu/attention.cpp) as [blocks * bs, KVH, D]."""
    kvh, blocks, width = k_cache.shape
    bs = width // head_dim
    k = k_cache.view(kvh, blocks, head_dim // 2, bs, 2).permute(1, 3, 0, 2, 4)
    v = v_cache.view(kvh, blocks, bs // 2, head_dim, 2).permute(1, 2, 4, 0, 3)
    return k.reshape(-1, kvh, head_dim), v.reshape(-1, kvh, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_attention_matches_portable_backend(seqs, heads, block_size, dtype):
    check_attention_against_portable(seqs, heads, block_size, dtype, window=0, softcap=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 24), (4, 1, 256)], ids=lambda h: "h{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (33, 0.0), (0, 2.0), (20, 1.5)])
def test_windowed_and_capped_attention_matches_portable_backend(window, softcap, heads, dtype):
    """Sliding windows shorter and longer than a tile (16 keys), starting mid-tile; softcaps small
    enough to bend every score (scaled scores of these inputs reach about 4); Gemma's head_dim 256
    on the vectorised path."""
    check_attention_against_portable(MIXED, heads, 16, dtype, window, softcap)


def check_attention_against_portable(seqs, heads, block_size, dtype, window: int, softcap: float) -> None:
    """With a window, the blocks behind each sequence's window are freed (-1 in its table), as the
    block manager frees them where every layer slides."""
    q, k, v, prefix_k, prefix_v, prefix_slots, num_blocks, layout = paged_step(seqs, *heads, block_size, dtype)
    if window:
        layout = freed_behind_window(layout, window, block_size)
    scale = heads[2] ** -0.5
    # The reference runs in fp32 on the same (bf16-representable) values, over a zeroed cache.
    ref_backend = TorchNativeBackend(*heads, block_size)
    ref_caches = [torch.zeros(ref_backend.kv_cache_shape(num_blocks)) for _ in range(2)]
    for cache, rows in zip(ref_caches, (prefix_k, prefix_v)):
        cache.view(-1, *rows.shape[1:])[prefix_slots] = rows.float()
    ref = ref_backend.forward(q.float(), k.float(), v.float(), *ref_caches, ref_backend.prepare(layout), scale,
                              window, softcap)

    backend = CPUBackend(*heads, block_size)
    caches = [torch.full(backend.kv_cache_shape(num_blocks), float("nan"), dtype=dtype) for _ in range(2)]
    torch.ops.nanovllm_cpu.store_kv(prefix_k, prefix_v, *caches, prefix_slots)
    out = backend.forward(q, k, v, *caches, backend.prepare(layout), scale, window, softcap)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[prefix_slots] = written[layout.slot_mapping] = True
    for cache, ref_cache in zip(token_major(*caches, heads[2]), ref_caches):
        assert torch.equal(cache[written].float(), ref_cache.view_as(cache)[written])
        assert cache[~written].isnan().all()  # nothing wrote or read outside the sequences' slots
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        # bf16 keeps 8 significant bits: the output's own rounding is up to 2^-9 relative, and the
        # kernel rounds the softmax probabilities to bf16 before the value sum (as flash attention
        # does), which adds about as much again on outputs of size ~1.
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def one_ulp_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether bf16 values are equal or neighbours (same sign and binade, or across one)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return ((ai - bi).abs() <= 1) | ((a == 0) & (b == 0))


def assert_matches_eager(out: torch.Tensor, ref: torch.Tensor):
    """The kernels round where eager bf16 PyTorch does, so only the last bit of an exp or of a
    sum's order can differ: each value equal or one bf16 step away, nearly all equal."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.bfloat16
    assert one_ulp_apart(out, ref).all()
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 3, 24, 25, 40, 300])
@pytest.mark.parametrize("n, k", [(64, 64), (40, 33), (960, 576)])
def test_packed_linear_matches_fp32(n, k, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = cpu_kernels.linear_packed(x, cpu_kernels.pack_linear_weight(w), b, n)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # fp32 accumulation in another order, then one rounding to bf16 (2^-9 relative).
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-3 * k ** 0.5)


def test_packed_linear_reads_rows_with_a_stride():
    """x may be a column slice of a wider tensor (rows apart by more than K)."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 100, generator=gen).bfloat16()
    x = wide[:, 10:74]
    w = torch.randn(48, 64, generator=gen).bfloat16()
    out = cpu_kernels.linear_packed(x, cpu_kernels.pack_linear_weight(w), None, 48)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=2 ** -8, atol=1e-2)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("rows", [1, 64, 65, 300])
def test_linear_op_equals_torch_on_both_kernels(rows):
    """Up to the crossover the packed kernel, above it oneDNN's GEMM on its own packed copy
    (bf16, or fp32 where the CPU has no bf16 arithmetic); both sum in fp32 and round once, so
    they equal the fp32 product rounded to bf16 but for the order of the sums: each value equal
    or one bf16 step away."""
    torch.manual_seed(rows)
    w, b = torch.randn(100, 96, dtype=torch.bfloat16), torch.randn(100, dtype=torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)

    class Owner:
        pass

    owner = Owner()
    handle = cpu_kernels.onednn_pack(w, owner)
    out = torch.ops.nanovllm_cpu.linear(x, w, cpu_kernels.pack_linear_weight(w), b, 64, handle)
    assert_matches_eager(out, F.linear(x.float(), w.float(), b.float()).bfloat16())
    del owner  # releases oneDNN's copy; its handle must not silently reach freed memory
    gc.collect()
    if rows > 64:
        with pytest.raises(RuntimeError, match="was released"):
            torch.ops.nanovllm_cpu.linear(x, w, cpu_kernels.pack_linear_weight(w), b, 64, handle)


def test_sample_rows_draws_by_inverse_transform():
    """Each row's token is where its uniform falls in the cumulative probabilities of
    softmax(logits / T) (to rounding), banned (-inf) tokens are never drawn, and a uniform next
    to 1 draws the last token that may be drawn."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 200, 1007  # not a multiple of the kernel's 16 lanes
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[:, ::3] = float("-inf")
    logits[:, -1] = float("-inf")
    temperatures = torch.rand(n, generator=gen) + 0.2
    uniform = torch.rand(n, generator=gen)
    logits[-1] = torch.where(torch.isfinite(logits[-1]), 0.0, float("-inf"))  # equal odds
    uniform[-1] = 1 - 2 ** -24
    tokens = torch.ops.nanovllm_cpu.sample_rows(logits, temperatures, uniform)
    cdf = torch.softmax(logits.double() / temperatures.double().unsqueeze(1), dim=-1).cumsum(dim=-1)
    target = uniform.double()
    before = torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0)
    at = cdf.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert (before <= target + 1e-5).all() and (at >= target - 1e-5).all()
    assert torch.isfinite(logits.gather(1, tokens.unsqueeze(1))).all()
    assert tokens[-1] == torch.isfinite(logits[-1]).nonzero().max()


GATED = {"silu": (lambda x: torch.ops.nanovllm_cpu.silu_and_mul(x), F.silu),
         "gelu_tanh": (lambda x: torch.ops.nanovllm_cpu.gelu_tanh_and_mul(x),
                       lambda gate: F.gelu(gate, approximate="tanh"))}


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("shape", [(1, 3072), (37, 3072), (2, 5, 70), (300, 46)], ids=str)
def test_gated_activations_match_eager(shape, activation):
    """Widths with and without a tail past the 16 lanes, leading dims, gates far into both
    tails of the activation, and an input that is a column slice of a wider tensor."""
    kernel, act = GATED[activation]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 4).bfloat16()
    x.view(-1)[:8] = torch.tensor([-100.0, -88.5, -20.0, 0.0, 20.0, 88.5, 100.0, -0.0]).bfloat16()
    wide = torch.cat([x, x], dim=-1)[..., 3:3 + x.shape[-1]]
    for x in (x, wide):
        gate, up = x.chunk(2, dim=-1)
        out, ref = kernel(x), act(gate) * up
        if activation == "gelu_tanh":
            # Eager's 1 + tanh(u) cancels where tanh(u) nears -1 (gates below about -3), leaving
            # multiples of 2^-24 that the kernel's 2 sigmoid(2u) resolves: there it is nearer the
            # true value and agrees with eager's activation to 2^-20 only (times `up`).
            tiny = ref.float().abs() < 2 ** -12
            bound = 2 ** -20 * up.float().abs().clamp(min=1)
            assert ((out.float() - ref.float()).abs() <= bound)[tiny].all()
            out, ref = out[~tiny], ref[~tiny]
        assert_matches_eager(out, ref)


@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (3, 4, 128), (300, 40)], ids=str)
def test_rms_norm_matches_the_layer_in_eager(shape):
    """The kernels against RMSNorm's own PyTorch path, with and without the residual add;
    the sum handed back as the next residual is exact."""
    from nanovllm.layers.layernorm import RMSNorm
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.copy_(torch.rand(shape[-1], generator=gen) + 0.5)
    norm = norm.bfloat16()
    x = (torch.randn(shape, generator=gen) * 3).bfloat16()
    residual = torch.randn(shape, generator=gen).bfloat16()
    ref, ref_sum = norm(x, residual)
    ref_plain = norm(x)
    out, summed = norm.forward_cpu(x, residual)
    assert torch.equal(summed, ref_sum)
    assert_matches_eager(out, ref)
    assert_matches_eager(norm.forward_cpu(x), ref_plain)
    assert_matches_eager(norm.forward_cpu(x.transpose(0, -1).contiguous().transpose(0, -1)), ref_plain)  # strided
    # Rows read in place from a wider tensor (a step's qkv rows: a token's heads back to back, the
    # tokens a row apart, as the q/k norms take them): the same bits as the contiguous rows.
    rows = x.reshape(-1, shape[-1]) if len(shape) == 2 else x.reshape(shape[0], -1)
    wide = torch.cat([rows, torch.randn(rows.shape[0], 64, generator=gen).bfloat16()], dim=1)
    in_place = wide[:, :rows.shape[1]].view(shape)
    assert shape[0] == 1 or not in_place.is_contiguous()
    assert torch.equal(norm.forward_cpu(in_place), norm.forward_cpu(x))
    out_in_place, summed_in_place = norm.forward_cpu(in_place, residual)
    assert torch.equal(out_in_place, out) and torch.equal(summed_in_place, summed)


def _pool_inputs() -> list[tuple]:
    """Inputs of kernels over the pool: a GGUF linear on both paths, the packed bf16 linear, an
    RMSNorm."""
    import numpy as np

    from conftest import random_gguf_blocks

    gen = torch.Generator().manual_seed(3)
    blocks = torch.from_numpy(random_gguf_blocks("Q4_0", 700, 512, np.random.default_rng(3)))
    lanes = torch.ops.nanovllm_cpu.gguf_repack(blocks, 2, 512)
    w = torch.randn(300, 256, generator=gen).to(torch.bfloat16)
    packed, ones = cpu_kernels.pack_linear_weight(w), torch.ones(256, dtype=torch.bfloat16)
    return [(torch.randn(rows, 512, generator=gen), lanes, torch.randn(rows, 256, generator=gen).to(torch.bfloat16),
             packed, ones) for rows in (1, 7, 40)]


def _pool_outputs(inputs: list[tuple]) -> list[torch.Tensor]:
    """Only the kernels run here (a forked child must not enter torch's own OpenMP pool)."""
    outputs = []
    for x, lanes, xb, packed, ones in inputs:
        outputs.append(torch.ops.nanovllm_cpu.gguf_linear(x, lanes, 1002, None, 10))
        outputs.append(torch.ops.nanovllm_cpu.linear_packed(xb, packed, None, 300))
        outputs.append(torch.ops.nanovllm_cpu.rms_norm(xb, ones, 1e-6))
    return outputs


def test_the_pool_gives_the_same_bits_on_any_number_of_threads():
    """Pieces go to whichever thread takes them; every element is computed the same way."""
    threads = torch.get_num_threads()
    inputs = _pool_inputs()
    try:
        torch.set_num_threads(1)
        alone = _pool_outputs(inputs)
        # 3 and 4: more threads than a two-core machine has, so some are descheduled mid-job and the
        # others take over their pieces.
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            for a, b in zip(alone, _pool_outputs(inputs)):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


def test_a_forked_child_runs_the_kernels_on_a_pool_of_its_own():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        inputs = _pool_inputs()
        expected = _pool_outputs(inputs)  # the parent's pool now has a worker
        pid = os.fork()
        if pid == 0:  # the child has the pool's state but not its worker thread
            ok = all(torch.equal(a, b) for a, b in zip(expected, _pool_outputs(inputs)))
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60  # a child waiting on its parent's workers would hang
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        status = done[1]
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the kernels")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)
