"""Linear methods are chosen when each layer is built (layers/quantization/chooser.py): from the
checkpoint's block types through the model's packed modules, by the layer's prefix, and never
swapped after load."""

import logging
from types import SimpleNamespace

import pytest
import torch

from nanovllm.distributed.parallel_state import SINGLE, TPGroup
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.quantization import UnquantizedLinearMethod
from nanovllm.layers.quantization.chooser import LinearMethodChooser
from nanovllm.layers.quantization.moe_methods import UnquantizedMoEMethod
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM


class DenseMethod(UnquantizedLinearMethod):
    """What the platform gives a layer that multiplies a dense weight."""


class InvariantDenseMethod(DenseMethod):
    """What it gives one whose rows must not depend on the step's others (a router)."""


class DenseExperts(UnquantizedMoEMethod):
    pass


class BlockExperts(UnquantizedMoEMethod):
    def __init__(self, gate_up_type, down_type):
        self.types = (gate_up_type, down_type)


class BlockMethod(UnquantizedLinearMethod):
    def __init__(self, shard_types, projection):
        self.shard_types, self.projection = shard_types, projection


class RecordingPlatform:
    """Runs blocks of every type but Q2_K, recording what it was asked."""

    def __init__(self):
        self.asked = []

    def dense_linear_method(self, batch_invariant=False):
        return InvariantDenseMethod() if batch_invariant else DenseMethod()

    def block_linear_method(self, shard_types, projection=""):
        self.asked.append(shard_types)
        return None if "Q2_K" in shard_types.values() else BlockMethod(shard_types, projection)

    def dense_moe_method(self):
        return DenseExperts()

    def block_moe_method(self, gate_up_type, down_type):
        return BlockExperts(gate_up_type, down_type)


def llama_config(tied: bool, hidden: int = 64, layers: int = 2):
    return SimpleNamespace(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=None,
                           intermediate_size=2 * hidden, num_hidden_layers=layers, rms_norm_eps=1e-6,
                           vocab_size=100, max_position_embeddings=256, rope_theta=10000.0, rope_scaling=None,
                           hidden_act="silu", tie_word_embeddings=tied, attention_bias=False)


def build(block_types: dict[str, str], tied: bool, hidden: int, tp_group: TPGroup = SINGLE):
    chooser = LinearMethodChooser(RecordingPlatform(), block_types, LlamaForCausalLM.packed_modules_mapping)
    model = LlamaForCausalLM(llama_config(tied, hidden), tp_group, chooser)
    return model, chooser


def methods_by_name(model) -> dict[str, type]:
    return {name: type(m.linear_method) for name, m in model.named_modules() if hasattr(m, "linear_method")}


def test_each_layer_takes_the_method_its_checkpoint_tensors_ask_for(caplog):
    """Layer 0 all in blocks (q/k in one type, v in another: the platform hears each shard's);
    layer 1's v in a type the platform does not run, so its packed qkv stays dense; its MLP has no
    block tensors at all. The untied head multiplies; the embedding only looks rows up. Each
    block method hears which projection it is."""
    layer = "model.layers.{}.{}.weight".format
    block_types = {layer(0, "self_attn.q_proj"): "Q4_K", layer(0, "self_attn.k_proj"): "Q4_K",
                   layer(0, "self_attn.v_proj"): "Q6_K", layer(0, "self_attn.o_proj"): "Q4_K",
                   layer(0, "mlp.gate_proj"): "Q4_0", layer(0, "mlp.up_proj"): "Q4_0",
                   layer(0, "mlp.down_proj"): "Q8_0",
                   layer(1, "self_attn.q_proj"): "Q4_K", layer(1, "self_attn.k_proj"): "Q4_K",
                   layer(1, "self_attn.v_proj"): "Q2_K", layer(1, "self_attn.o_proj"): "Q4_K",
                   "model.embed_tokens.weight": "Q8_0"}
    with caplog.at_level(logging.INFO, logger="nanovllm.layers.quantization.chooser"):
        model, chooser = build(block_types, tied=False, hidden=256)  # rows of whole Q4_K blocks
        chooser.log_dequantized()
    methods = methods_by_name(model)
    assert methods == {
        "model.embed_tokens": BlockMethod,
        "model.layers.0.self_attn.qkv_proj": BlockMethod, "model.layers.0.self_attn.o_proj": BlockMethod,
        "model.layers.0.mlp.gate_up_proj": BlockMethod, "model.layers.0.mlp.down_proj": BlockMethod,
        "model.layers.1.self_attn.qkv_proj": DenseMethod, "model.layers.1.self_attn.o_proj": BlockMethod,
        "model.layers.1.mlp.gate_up_proj": DenseMethod, "model.layers.1.mlp.down_proj": DenseMethod,
        "lm_head": DenseMethod}
    qkv = model.model.layers[0].self_attn.qkv_proj.linear_method
    assert qkv.shard_types == {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    told = {name: m.linear_method.projection for name, m in model.named_modules()
            if isinstance(getattr(m, "linear_method", None), BlockMethod)}
    assert told == {"model.embed_tokens": "embed_tokens", "model.layers.0.self_attn.qkv_proj": "qkv_proj",
                    "model.layers.0.self_attn.o_proj": "o_proj", "model.layers.0.mlp.gate_up_proj": "gate_up_proj",
                    "model.layers.0.mlp.down_proj": "down_proj", "model.layers.1.self_attn.o_proj": "o_proj"}
    assert chooser.kept_in_blocks == {n: t for n, t in block_types.items() if not n.startswith("model.layers.1.self_attn.")
                                      or n.endswith("o_proj.weight")}
    assert [r.getMessage() for r in caplog.records] == [
        "dequantizing at load the weights of 1 layers this platform does not run in blocks (1 Q2_K/Q4_K)"]


def test_a_lookup_only_embedding_stays_plain_and_a_tied_head_is_the_embedding():
    untied, _ = build({}, tied=False, hidden=64)
    assert type(untied.model.embed_tokens.linear_method) is UnquantizedLinearMethod
    assert type(untied.lm_head.linear_method) is DenseMethod
    tied, _ = build({}, tied=True, hidden=64)
    assert tied.lm_head is tied.model.embed_tokens
    assert type(tied.lm_head.linear_method) is DenseMethod  # it multiplies, for the logits


def test_a_row_parallel_shard_narrower_than_a_block_stays_dense():
    """hidden 64 at tp=2: o_proj's and down_proj's rows hold 32 and 64 values a rank, half a Q4_K
    block (256) and a whole Q8_0 one (32)."""
    block_types = {"model.layers.0.self_attn.o_proj.weight": "Q4_K", "model.layers.0.mlp.down_proj.weight": "Q8_0"}
    model, chooser = build(block_types, tied=True, hidden=64, tp_group=TPGroup(0, 2))
    assert type(model.model.layers[0].self_attn.o_proj.linear_method) is DenseMethod
    assert type(model.model.layers[0].mlp.down_proj.linear_method) is BlockMethod
    assert chooser.kept_in_blocks == {"model.layers.0.mlp.down_proj.weight": "Q8_0"}


@pytest.mark.skipif(not cpu_kernels.has_simd_kernels(), reason="needs the avx2 or avx512 CPU kernels")
def test_bf16_layers_on_the_kernels_share_one_packed_arena():
    """On the CPU platform in bf16, every layer that multiplies is built with the one packed
    method, whose arena, sized as they were built, holds each layer's packed copy once loaded."""
    from nanovllm.layers.quantization.cpu_packed_bf16 import CPUPackedBF16LinearMethod
    from nanovllm.platforms.cpu import CPUPlatform

    platform = CPUPlatform(torch.device("cpu"), torch.bfloat16, True, SINGLE)
    chooser = LinearMethodChooser(platform, {}, LlamaForCausalLM.packed_modules_mapping)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(llama_config(tied=True), SINGLE, chooser)
    finally:
        torch.set_default_dtype(default)
    layers = [m for m in model.modules() if hasattr(m, "linear_method")]
    method = layers[0].linear_method
    assert all(m.linear_method is method for m in layers) and type(method) is CPUPackedBF16LinearMethod
    for m in layers:
        m.weight.data.normal_()
        method.process_weights_after_loading(m)
    arena = method.arena
    assert method.arena_filled == method.arena_elements == arena.numel()
    for m in layers:
        assert arena.data_ptr() <= m.packed_weight.data_ptr() < arena.data_ptr() + arena.nbytes
        x = torch.randn(2, m.weight.shape[1]).bfloat16()
        torch.testing.assert_close(cpu_kernels.linear_packed(x, m.packed_weight, None, m.weight.shape[0]),
                                   x @ m.weight.T)


def qwen3_moe_config(hidden: int = 256, experts: int = 4):
    return SimpleNamespace(**{**vars(llama_config(tied=True, hidden=hidden)), "num_experts": experts,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": True,
                              "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": 64})


def test_experts_take_the_block_method_when_every_one_comes_in_blocks(caplog):
    """Layer 0's experts: gate/up in Q4_K, down in Q6_K (Q4_K_M's mix): the block MoE method.
    Layer 1's: one expert's up in another type than the rest: dense, and logged. Routers are
    built batch-invariant."""
    experts = "model.layers.{}.mlp.experts.{}.{}_proj.weight".format
    block_types = {experts(0, e, p): ("Q6_K" if p == "down" else "Q4_K") for e in range(4) for p in ("gate", "up", "down")}
    block_types |= {experts(1, e, p): "Q4_K" for e in range(4) for p in ("gate", "up", "down")}
    block_types[experts(1, 2, "up")] = "Q8_0"
    chooser = LinearMethodChooser(RecordingPlatform(), block_types, Qwen3MoeForCausalLM.packed_modules_mapping,
                                  Qwen3MoeForCausalLM.expert_params_mapping)
    with caplog.at_level(logging.INFO, logger="nanovllm.layers.quantization.chooser"):
        model = Qwen3MoeForCausalLM(qwen3_moe_config(), SINGLE, chooser)
        chooser.log_dequantized()
    blocks, dense = (model.model.layers[i].mlp.experts.moe_method for i in (0, 1))
    assert type(blocks) is BlockExperts and blocks.types == ("Q4_K", "Q6_K")
    assert type(dense) is DenseExperts
    assert chooser.kept_in_blocks == {n: t for n, t in block_types.items() if ".layers.0." in n}
    assert all(type(layer.mlp.gate.linear_method) is InvariantDenseMethod for layer in model.model.layers)
    assert [r.getMessage() for r in caplog.records] == [
        "dequantizing at load the weights of 1 layers this platform does not run in blocks (1 Q4_K/Q8_0)"]


@pytest.mark.skipif(not cpu_kernels.has_simd_kernels(), reason="needs the avx2 or avx512 CPU kernels")
def test_the_cpus_batch_invariant_dense_method_computes_a_row_alike_in_any_step():
    """What a router gets on CPU in bf16: the packed kernel at every step size, each row's output
    the same bits alone as in a step of 300 rows (oneDNN's GEMM, which larger steps of the other
    dense layers take, differs in a few)."""
    from torch import nn

    from nanovllm.platforms.cpu import CPUPlatform

    method = CPUPlatform(torch.device("cpu"), torch.bfloat16, True, SINGLE).dense_linear_method(batch_invariant=True)
    layer = nn.Module()
    layer.weight_loader = None
    method.create_weights(layer, 1024, 64, False)
    layer.weight.data = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    method.process_weights_after_loading(layer)
    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(1)).bfloat16()
    batch = method.apply(layer, x, None)
    assert torch.equal(torch.cat([method.apply(layer, x[i:i + 1], None) for i in range(300)]), batch)
