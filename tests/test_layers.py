"""Parallel layers, norm, activation and RoPE against their unsharded / HF references.

TP layers are built as rank-0 and rank-1 copies in one process (`TPGroup` without a
process group: collectives are no-ops), and their outputs combined by hand.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from nanovllm.distributed.parallel_state import SINGLE, TPGroup
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    ReplicatedLinear, RowParallelLinear)
from nanovllm.layers.rotary_embedding import get_rope, rope_parameters_from_config

torch.manual_seed(0)


def ranks(world_size: int) -> list[TPGroup]:
    return [TPGroup(rank=r, world_size=world_size) for r in range(world_size)]


def load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def test_replicated_linear():
    w, b, x = torch.randn(6, 4), torch.randn(6), torch.randn(3, 4)
    layer = ReplicatedLinear(4, 6, bias=True)
    load(layer, "weight", w)
    load(layer, "bias", b)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_column_parallel_concatenates():
    w, b, x = torch.randn(8, 4), torch.randn(8), torch.randn(3, 4)
    outs = []
    for g in ranks(2):
        layer = ColumnParallelLinear(4, 8, tp_group=g, bias=True)
        load(layer, "weight", w)
        load(layer, "bias", b)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


def test_row_parallel_sums_with_bias_on_rank0_only():
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    outs = []
    for g, x_part, w_part in zip(ranks(2), x.chunk(2, -1), w.chunk(2, -1)):
        layer = RowParallelLinear(8, 5, tp_group=g, bias=True)
        load(layer, "weight", w)
        load(layer, "bias", b)
        outs.append(layer(x_part))
        if g.rank == 1:
            torch.testing.assert_close(outs[-1], x_part @ w_part.T)
    torch.testing.assert_close(outs[0] + outs[1], F.linear(x, w, b))


def test_merged_column_cuts_projection_then_rank():
    gate, up, x = torch.randn(6, 4), torch.randn(6, 4), torch.randn(3, 4)
    parts = []
    for g in ranks(2):
        layer = MergedColumnParallelLinear(4, [6, 6], tp_group=g)
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        parts.append(layer(x).chunk(2, -1))  # this rank's [gate chunk | up chunk]
    torch.testing.assert_close(torch.cat([p[0] for p in parts], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], -1), x @ up.T)


def _qkv_weights(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int):
    return (torch.randn(num_heads * head_dim, hidden), torch.randn(num_kv_heads * head_dim, hidden),
            torch.randn(num_kv_heads * head_dim, hidden), torch.randn(num_heads * head_dim),
            torch.randn(num_kv_heads * head_dim), torch.randn(num_kv_heads * head_dim))


@pytest.mark.parametrize("num_heads,num_kv_heads,world_size", [(4, 2, 2), (4, 2, 4), (4, 1, 2), (6, 6, 3)])
def test_qkv_parallel_splits_heads_and_replicates_kv(num_heads, num_kv_heads, world_size):
    head_dim, hidden = 3, 8
    wq, wk, wv, bq, bk, bv = _qkv_weights(num_heads, num_kv_heads, head_dim, hidden)
    x = torch.randn(5, hidden)
    full_q = F.linear(x, wq, bq).view(5, num_heads, head_dim)
    full_k = F.linear(x, wk, bk).view(5, num_kv_heads, head_dim)
    full_v = F.linear(x, wv, bv).view(5, num_kv_heads, head_dim)
    q_per_rank = num_heads // world_size
    for g in ranks(world_size):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, tp_group=g, bias=True)
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            load(layer, "weight", w, shard)
            load(layer, "bias", b, shard)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
        my_q = list(range(g.rank * q_per_rank, (g.rank + 1) * q_per_rank))
        # Each rank must hold the KV heads its query heads attend with (GQA groups).
        my_kv = sorted({h * num_kv_heads // num_heads for h in my_q})
        assert layer.num_kv_heads == len(my_kv)
        torch.testing.assert_close(q.view(5, -1, head_dim), full_q[:, my_q])
        torch.testing.assert_close(k.view(5, -1, head_dim), full_k[:, my_kv])
        torch.testing.assert_close(v.view(5, -1, head_dim), full_v[:, my_kv])


@pytest.mark.parametrize("num_heads,num_kv_heads,world_size,name", [
    (9, 3, 2, "num_attention_heads"), (6, 3, 2, "num_key_value_heads"), (12, 3, 4, "num_key_value_heads"),
])
def test_qkv_rejects_indivisible_heads(num_heads, num_kv_heads, world_size, name):
    with pytest.raises(ValueError, match=name):
        QKVParallelLinear(8, 2, num_heads, num_kv_heads, tp_group=TPGroup(0, world_size))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_checkpoint_tensor_packed_already_loads_as_its_projections(world_size):
    """Phi-3 stores q/k/v and gate/up packed: handed whole (no shard id), each rank takes the same
    rows as from the projections handed one by one."""
    qkv, gate_up = torch.randn(16, 8), torch.randn(12, 4)
    for g in ranks(world_size):
        whole, parts = (QKVParallelLinear(8, 2, 4, 2, tp_group=g) for _ in range(2))
        load(whole, "weight", qkv)
        for shard, rows in zip("qkv", qkv.split([8, 4, 4])):
            load(parts, "weight", rows, shard)
        assert torch.equal(whole.weight, parts.weight)
        whole, parts = (MergedColumnParallelLinear(4, [6, 6], tp_group=g) for _ in range(2))
        load(whole, "weight", gate_up)
        for shard, rows in enumerate(gate_up.split([6, 6])):
            load(parts, "weight", rows, shard)
        assert torch.equal(whole.weight, parts.weight)


def test_packed_loaders_reject_bad_shards_and_shapes():
    layer = QKVParallelLinear(8, 2, 4, 2, tp_group=SINGLE)
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        load(layer, "weight", torch.randn(8, 8), "x")
    with pytest.raises(ValueError, match=r"a packed tensor of 16 rows \(8 \+ 4 \+ 4\) expected, got 8"):
        load(layer, "weight", torch.randn(8, 8))  # no shard: the whole q/k/v
    with pytest.raises(ValueError, match="expected shape"):
        load(layer, "weight", torch.randn(8, 8), "k")
    merged = MergedColumnParallelLinear(4, [6, 6], tp_group=TPGroup(0, 2))
    with pytest.raises(ValueError, match="expected shape"):
        load(merged, "weight", torch.randn(3, 4), 0)  # a pre-sharded tensor is not a checkpoint tensor


def test_vocab_parallel_embedding_masks_and_sums():
    vocab, hidden = 11, 4  # odd: the last shard carries a padding row
    w = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 6, 10, 3, 7])
    outs = []
    for g in ranks(2):
        emb = VocabParallelEmbedding(vocab, hidden, tp_group=g)
        load(emb, "weight", w)
        assert emb.weight.shape == (6, hidden)
        outs.append(emb(ids))
    assert torch.all(emb.weight[-1] == 0)
    torch.testing.assert_close(outs[0] + outs[1], F.embedding(ids, w))


def test_lm_head_concatenates_and_trims_padding():
    vocab, hidden = 11, 4
    w, h = torch.randn(vocab, hidden), torch.randn(3, hidden)
    outs = []
    for g in ranks(2):
        head = ParallelLMHead(vocab, hidden, tp_group=g)
        load(head, "weight", w)
        outs.append(head(h))
    torch.testing.assert_close(torch.cat(outs, -1)[:, :vocab], h @ w.T)
    single = ParallelLMHead(vocab, hidden, tp_group=SINGLE)
    load(single, "weight", w)
    assert single(h).shape == (3, vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_and_never_aliases(dtype):
    x, r = torch.randn(3, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    norm, ref = RMSNorm(16, eps=1e-5).to(dtype), LlamaRMSNorm(16, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16))
        norm.weight.copy_(ref.weight)
    out = norm(x)
    torch.testing.assert_close(out, ref(x))
    normed, summed = norm(x, r)
    torch.testing.assert_close(summed, x0 + r0)
    torch.testing.assert_close(normed, ref(x0 + r0))
    assert torch.equal(x, x0) and torch.equal(r, r0)
    assert out.data_ptr() != x.data_ptr() and summed.data_ptr() not in (x.data_ptr(), r.data_ptr())


def test_silu_and_mul():
    x = torch.randn(3, 8)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:])


ROPE_CASES = {
    "default": dict(rope_theta=10000.0),
    "theta_1e6": dict(rope_theta=1e6),
    "linear": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "yarn": dict(rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 256}),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_matches_transformers(case):
    head_dim, heads, kv_heads, max_pos = 64, 4, 2, 1024
    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_pos, **ROPE_CASES[case])
    rope = get_rope(head_dim, max_pos, rope_parameters_from_config(config))
    positions = torch.cat([torch.arange(8), torch.randint(0, max_pos, (8,)), torch.tensor([max_pos - 1])])
    q, k = torch.randn(len(positions), heads * head_dim), torch.randn(len(positions), kv_heads * head_dim)
    q_out, k_out = rope(positions, q, k)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, -1, heads, head_dim).transpose(1, 2),
                                        k.view(1, -1, kv_heads, head_dim).transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(q.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(k.shape), atol=1e-5, rtol=1e-5)


def test_rope_parameters_from_legacy_config():
    legacy = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0}, max_position_embeddings=4096)
    params = rope_parameters_from_config(legacy)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 1e6
    assert params["original_max_position_embeddings"] == 4096
    bare = rope_parameters_from_config(SimpleNamespace(max_position_embeddings=16))
    assert bare == {"rope_type": "default", "rope_theta": 10000.0}


def test_rope_rejects_unsupported_type():
    with pytest.raises(ValueError, match="'dynamic'.*default, linear, llama3, yarn, longrope"):
        get_rope(64, 128, {"rope_type": "dynamic", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="longrope needs 12 short and long factors"):
        get_rope(32, 128, {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 11,
                           "long_factor": [1.0] * 12, "original_max_position_embeddings": 64,
                           "partial_rotary_factor": 0.75})


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_and_partial_rotary_match_transformers_phi3(partial):
    """Phi-3's LongRoPE (Phi-4-mini's with 3/4 of each head rotated): positions within the
    original context take the short factors, past it the long ones, as transformers' own
    rotation of a sequence that short or that long does."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    head_dim, heads, original, max_pos = 32, 2, 64, 256
    pairs = int(head_dim * partial) // 2
    gen = torch.Generator().manual_seed(0)
    factors = {name: (1 + torch.rand(pairs, generator=gen) * 3).tolist() for name in ("short_factor", "long_factor")}
    config = Phi3Config(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=heads,
                        max_position_embeddings=max_pos, original_max_position_embeddings=original,
                        partial_rotary_factor=partial, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                                        **factors})
    rope = get_rope(head_dim, max_pos, rope_parameters_from_config(config))
    for positions in (torch.arange(original), torch.arange(original, max_pos)):
        q, k = torch.randn(len(positions), heads * head_dim), torch.randn(len(positions), heads * head_dim)
        q_out, k_out = rope(positions, q, k)
        cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
        q_ref, k_ref = phi3_apply(q.view(1, -1, heads, head_dim).transpose(1, 2),
                                  k.view(1, -1, heads, head_dim).transpose(1, 2), cos, sin)
        torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(q.shape), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(k.shape), atol=1e-5, rtol=1e-5)
