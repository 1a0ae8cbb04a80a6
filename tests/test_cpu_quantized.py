"""The GGUF block kernels (kernels/cpu/quantized.cpp) against gguf-py and fp32 matmuls, and the
engine keeping a checkpoint's weights in blocks.

Dequantization: bit-exact against gguf-py's reference for every block format the kernels run.
The streaming kernel (few rows, x quantized to 16-bit blocks): against the fp32 product of the
dequantized weight and x, for rows in one pass, in passes split evenly, bf16 and fp32 x, with a
bias. The tiled kernel (many rows): the streaming kernel's results bit for bit, and each row's
alone (batch invariance). Real tensors of each type of the default file too. The lanes layouts (every type
repacked at load; the products take no other): dequantized bit for bit as the file's blocks, and both paths
within fp32 sums of the product as the kernels define it (x rounded to 16-bit chunks, in float64), for rows
of whole groups of 256 values, with a tail of blocks, and shorter than a group. A packed
layer whose projections differ in type: each part its own type's product, and a GGUF file whose
q/k/v and gate/up mix types loads every layer in blocks.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (make_tiny_checkpoint, random_gguf_blocks, requires_default_model,
                      write_tiny_gguf)
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.entrypoints.bench_twins import TwinShape
from nanovllm.layers.quantization.cpu_gguf import (LANES_TYPE_BASE, CPUGGUFLinearMethod, CPUGGUFPartsLinearMethod,
                                                   activation_bits, kernel_blocks)
from nanovllm.loader.quantized import BLOCK_TYPES, QuantizedTensor, block_values

if not cpu_kernels.available():
    pytest.skip("the CPU kernels could not be built here", allow_module_level=True)

import gguf  # noqa: E402

def random_blocks(qtype: str, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(random_gguf_blocks(qtype, rows, in_features, np.random.default_rng(seed)))


def reference_dequantize(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(values.reshape(blocks.shape[0], in_features).copy())


def reference_product(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int,
                      bits: int = 16) -> torch.Tensor:
    """x W^T as the kernels define it, in float64: each 32 values of x rounded to `bits`-bit
    integers at the chunk's fp32 scale (its largest magnitude over 32767, or 127 for 8 bits; ties
    to even), times the weight dequantized by gguf-py. Only the kernels' fp32 sums differ from it."""
    chunks = x.float().reshape(x.shape[0], -1, 32)
    scale = chunks.abs().amax(-1, keepdim=True) / (127.0 if bits == 8 else 32767.0)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    rounded = torch.round(chunks * inverse).double() * scale.double()
    return rounded.reshape(x.shape[0], -1) @ reference_dequantize(blocks, qtype, in_features).double().T


def assert_near_reference(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("rows,in_features", [(1, 256), (37, 512), (130, 768)])
def test_dequantize_matches_gguf(qtype, rows, in_features):
    blocks = random_blocks(qtype, rows, in_features)
    got = torch.ops.nanovllm_cpu.gguf_dequantize(blocks, BLOCK_TYPES[qtype], in_features)
    assert torch.equal(got, reference_dequantize(blocks, qtype, in_features))


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_kernel_is_the_product(qtype, m, dtype):
    """x in 16-bit blocks: the product of x itself to fp32 rounding (and bf16 output rounding)."""
    n, k = 37, 512
    blocks = random_blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = torch.ops.nanovllm_cpu.gguf_linear(x, *kernel_blocks(blocks, qtype, k), bias, 16)
    expected = x.float() @ reference_dequantize(blocks, qtype, k).T + bias.float()
    assert y.dtype == dtype and y.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("qtype,in_features", [(qtype, k) for qtype in BLOCK_TYPES for k in (256, 576, 1024)
                                                if k % block_values(qtype) == 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [37, 41])
@pytest.mark.parametrize("bits", [8, 16])
def test_tiled_kernel_is_the_streaming_kernel_bit_for_bit(qtype, in_features, dtype, m, bits):
    """Many rows of x (weight rows past a task's block and past a 16-row AMX tile, x rows past a
    tile: 37 leave a last tile of at most eight rows, 41 one of more, a row's tail of blocks, a
    bias, leading dims), x in 16-bit blocks or 8-bit ones (the K-quants' byte tiles): every
    element the same bits as the streaming kernel's, and as each row of x alone; and near the fp32
    product of x (to the rounding of x into its blocks)."""
    n = 611
    blocks = random_blocks(qtype, n, in_features)
    lanes, kind = kernel_blocks(blocks, qtype, in_features)
    x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(in_features)).to(dtype)
    bias = torch.randn(n).to(dtype)
    tiled = torch.ops.nanovllm_cpu.gguf_linear(x.view(1, m, in_features), lanes, kind, bias, 0, bits)
    assert tiled.dtype == dtype and tiled.shape == (1, m, n)
    assert torch.equal(tiled[0], torch.ops.nanovllm_cpu.gguf_linear(x, lanes, kind, bias, m, bits))
    alone = torch.cat([torch.ops.nanovllm_cpu.gguf_linear(x[i:i + 1], lanes, kind, bias, 10, bits)
                       for i in range(m)])
    assert torch.equal(tiled[0], alone)
    expected = x.float() @ reference_dequantize(blocks, qtype, in_features).T + bias.float()
    tolerance = 2e-2 if bits == 8 else 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(tiled[0].float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("qtype,in_features", [(qtype, k) for qtype in BLOCK_TYPES for k in (64, 256, 576, 1536)
                                                if k % block_values(qtype) == 0])  # rows of whole blocks
def test_lanes_layout_is_the_blocks(qtype, in_features):
    n = 37
    blocks = random_blocks(qtype, n, in_features)
    lanes = torch.ops.nanovllm_cpu.gguf_repack(blocks, BLOCK_TYPES[qtype], in_features)
    kind = LANES_TYPE_BASE + BLOCK_TYPES[qtype]
    # The same bytes a row, but a scale (and minimum) a byte each: Q4_K, Q5_K and IQ4_XS take 148,
    # 180 and 138 bytes a block of 256, not 144, 176 and 136.
    wider = {"Q4_K": 148, "Q5_K": 180, "IQ4_XS": 138}
    row_bytes = in_features // 256 * wider[qtype] if qtype in wider else blocks.shape[1]
    assert lanes.shape == (n, row_bytes) and lanes.dtype == torch.uint8
    assert torch.equal(torch.ops.nanovllm_cpu.gguf_dequantize(lanes, kind, in_features),
                       reference_dequantize(blocks, qtype, in_features))
    for m in (1, 2, 5, 10, 40):  # streaming in one pass, in two; tiled
        x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(m))
        for bits in (8, 16):  # 8: byte products where the values fit a byte (a tail's chunks in words)
            got = torch.ops.nanovllm_cpu.gguf_linear(x, lanes, kind, None, 10, bits)
            assert_near_reference(got, reference_product(x, blocks, qtype, in_features, bits))
    with pytest.raises(RuntimeError, match=f"type {BLOCK_TYPES[qtype]} is not a lanes layout"):
        torch.ops.nanovllm_cpu.gguf_linear(x, blocks, BLOCK_TYPES[qtype], None, 10)


@pytest.mark.parametrize("qtype,in_features", [("Q4_1", 576), ("Q4_K", 768), ("Q6_K", 512)])
def test_the_method_repacks_into_lanes(qtype, in_features):
    with pytest.raises(RuntimeError, match="no lanes layout"):
        torch.ops.nanovllm_cpu.gguf_repack(random_blocks("Q8_0", 2, 256), 10, 256)
    blocks = random_blocks(qtype, 8, in_features)
    layer = torch.nn.Module()
    method = CPUGGUFLinearMethod(qtype, torch.float32)
    method.create_weights(layer, in_features, 8, bias=False)
    layer.weight.data.copy_(blocks)
    method.process_weights_after_loading(layer)
    assert method.kernel_type == LANES_TYPE_BASE + BLOCK_TYPES[qtype]
    assert torch.equal(layer.weight, torch.ops.nanovllm_cpu.gguf_repack(blocks, BLOCK_TYPES[qtype], in_features))
    x = torch.randn(3, in_features)
    assert method.activation_bits == (8 if qtype in ("Q4_K", "Q6_K") else 16)
    assert_near_reference(method.apply(layer, x, None),
                          reference_product(x, blocks, qtype, in_features, method.activation_bits))
    ids = torch.tensor([5, 0, 7])
    torch.testing.assert_close(method.embed(layer, ids), reference_dequantize(blocks, qtype, in_features)[ids])


def test_activation_bits_by_the_layers_types_and_role():
    """8 bits where every type is a K-quant or IQ4_XS; in Q4_0 (mixed with K-quants too) on an
    MLP's gate/up projection and attention's output; 16 elsewhere, and for the other 32-value
    formats."""
    assert activation_bits(["Q4_K", "Q6_K"]) == activation_bits(["IQ4_XS"], "down_proj") == 8
    for projection in ("gate_up_proj", "o_proj"):
        assert activation_bits(["Q4_0"], projection) == activation_bits(["Q4_K", "Q4_0"], projection) == 8
        for qtype in ("Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"):
            assert activation_bits([qtype], projection) == activation_bits(["Q4_K", qtype], projection) == 16
    for projection in ("", "qkv_proj", "down_proj", "lm_head"):
        assert activation_bits(["Q4_0"], projection) == activation_bits(["Q4_K", "Q4_0"], projection) == 16
    assert CPUGGUFLinearMethod("Q4_0", torch.bfloat16, "o_proj").activation_bits == 8
    assert CPUGGUFPartsLinearMethod({0: "Q4_K", 1: "Q4_0"}, torch.bfloat16, "gate_up_proj").activation_bits == 8


def test_parts_of_differing_types_are_each_parts_product():
    """Rows of several types one after another: each part's columns are its own product, bit for
    bit (both paths, a bias across the parts); the table must describe the bytes exactly, in lanes
    layouts only."""
    k = 768
    parts = [("Q4_K", 40), ("Q6_K", 24), ("Q8_0", 9), ("Q4_1", 33)]
    files = [random_blocks(qtype, n, k, seed=i) for i, (qtype, n) in enumerate(parts)]
    rows, types = zip(*(kernel_blocks(r, qtype, k) for r, (qtype, _) in zip(files, parts)))
    blocks = torch.cat([r.reshape(-1) for r in rows])
    table = torch.tensor([(n, t) for (_, n), t in zip(parts, types)])
    n = sum(n for _, n in parts)
    bias = torch.randn(n)
    for m in (1, 3, 10, 11, 40):  # streaming in one pass and in two; tiled
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = torch.ops.nanovllm_cpu.gguf_linear_parts(x, blocks, table, n, bias, 10)
        each = [torch.ops.nanovllm_cpu.gguf_linear(x, r, t, None, 10) for r, t in zip(rows, types)]
        assert torch.equal(got, torch.cat(each, 1) + bias)  # the same sums in the same order
    x = torch.randn(2, k)
    with pytest.raises(RuntimeError, match="the parts' rows take"):
        torch.ops.nanovllm_cpu.gguf_linear_parts(x, blocks[:-1], table, n, None, 10)
    with pytest.raises(RuntimeError, match="not out_features=7"):
        torch.ops.nanovllm_cpu.gguf_linear_parts(x, blocks, table, 7, None, 10)
    mixed = torch.tensor([(40, types[0]), (24, BLOCK_TYPES["Q6_K"])])  # a part in the file's own layout
    with pytest.raises(RuntimeError, match="type 14 is not a lanes layout"):
        torch.ops.nanovllm_cpu.gguf_linear_parts(x, torch.cat([rows[0].reshape(-1), files[1].reshape(-1)]), mixed, 64,
                                                 None, 10)


def test_the_parts_method_loads_each_shard_in_its_own_type():
    """gate in Q4_K, up in Q6_K: the layer is built with the parts method, and its product is the
    two parts' own; a shard in another type, or dense, is refused naming the shard."""
    from nanovllm.distributed.parallel_state import SINGLE
    from nanovllm.layers.linear import MergedColumnParallelLinear
    from nanovllm.layers.quantization.chooser import LinearMethodChooser
    from nanovllm.platforms.cpu import CPUPlatform
    platform = CPUPlatform(torch.device("cpu"), torch.float32, True, SINGLE)
    chooser = LinearMethodChooser(platform, {"mlp.gate_proj.weight": "Q4_K", "mlp.up_proj.weight": "Q6_K"},
                                  {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})
    layer = MergedColumnParallelLinear(256, [24, 40], tp_group=SINGLE, linear_methods=chooser, prefix="mlp.gate_up_proj")
    method = layer.linear_method
    assert type(method) is CPUGGUFPartsLinearMethod
    assert chooser.kept_in_blocks == {"mlp.gate_proj.weight": "Q4_K", "mlp.up_proj.weight": "Q6_K"}
    gate, up = random_blocks("Q4_K", 24, 256, seed=1), random_blocks("Q6_K", 40, 256, seed=2)
    with pytest.raises(ValueError, match="expected Q6_K blocks for shard 1, got Q4_K"):
        layer.weight.weight_loader(layer.weight, QuantizedTensor(gate, "Q4_K", 256), 1)
    with pytest.raises(ValueError, match="expected Q4_K blocks for shard 0, got a dense"):
        layer.weight.weight_loader(layer.weight, torch.randn(24, 256), 0)
    layer.weight.weight_loader(layer.weight, QuantizedTensor(gate, "Q4_K", 256), 0)
    layer.weight.weight_loader(layer.weight, QuantizedTensor(up, "Q6_K", 256), 1)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 256)
    assert method.activation_bits == 8  # both K-quants
    assert_near_reference(layer(x), torch.cat([reference_product(x, gate, "Q4_K", 256, 8),
                                               reference_product(x, up, "Q6_K", 256, 8)], 1))


def test_a_file_mixing_types_in_packed_layers_keeps_every_layer_in_blocks(tmp_path):
    """Q4_K_M-like: q and k in Q4_K, v in Q6_K, gate in Q4_0 and up in Q8_0. Every linear layer
    stays in blocks (the packed ones in parts), agrees with the file dequantized at load, and runs
    fused as eager does."""
    shape = TwinShape("qwen3", 256, 512, 2, 4, 2, 64, 320, 10000.0, 1e-6, 256, True)
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "ffn_gate": "Q4_0", "ffn_up": "Q8_0"}
    path = write_tiny_gguf(tmp_path / "mixed.gguf", shape,
                           lambda name: types.get(name.split(".")[-2], "Q4_1" if name.startswith("blk") else "Q8_0"))
    settings = dict(num_kvcache_blocks=16, max_model_len=128)
    blocks = LLM(path, dtype="float32", enforce_eager=True, **settings)
    model = blocks.llm_engine.executor.model
    methods = {name.split(".")[-1]: type(m.linear_method) for name, m in model.named_modules()
               if hasattr(m, "linear_method")}
    assert methods == {"embed_tokens": CPUGGUFLinearMethod,  # the LM head too: tied, the same module
                       "qkv_proj": CPUGGUFPartsLinearMethod, "o_proj": CPUGGUFLinearMethod,
                       "gate_up_proj": CPUGGUFPartsLinearMethod, "down_proj": CPUGGUFLinearMethod}
    assert model.lm_head is model.model.embed_tokens
    qkv = model.model.layers[0].self_attn.qkv_proj.linear_method
    assert qkv.parts.tolist() == [[256 + 128, LANES_TYPE_BASE + BLOCK_TYPES["Q4_K"]],
                                  [128, LANES_TYPE_BASE + BLOCK_TYPES["Q6_K"]]]  # q and k: one run
    dense = LLM(path, dtype="float32", enforce_eager=True, quantization="dense", **settings)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = [list(range(3, 60))]
    logprobs = [[next(iter(p.values())).logprob for p in llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]]
                for llm in (blocks, dense)]
    # q/k/v's x in 8 bits (all K-quants), the other layers' in 16.
    torch.testing.assert_close(torch.tensor(logprobs[0]), torch.tensor(logprobs[1]), rtol=0, atol=1e-2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    fused, eager = (LLM(path, dtype="bfloat16", enforce_eager=eager, **settings) for eager in (False, True))
    outs = [[(o.token_ids, o.cumulative_logprob) for o in llm.generate(prompt * 2, greedy, use_tqdm=False)[0].outputs]
            for llm in (fused, eager)]
    assert outs[0] == outs[1]


def mapping_of(address: int) -> tuple[int, int, set[str]]:
    """The start, end and VmFlags of this process's mapping that holds `address`."""
    found = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(a, 16) for a in head.split("-"))
            found = (start, end) if start <= address < end else None
        elif found and line.startswith("VmFlags:"):
            return (*found, set(line.split()[1:]))
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_block_weights_lie_in_one_huge_page_arena(tmp_path):
    """A decode step streams every block weight: they are moved into one mapping advised for
    transparent huge pages ('hg'), from a 2 MB boundary, and still compute what the file says."""
    shape = TwinShape("qwen3", 256, 512, 2, 4, 2, 64, 320, 10000.0, 1e-6, 256, True)
    path = write_tiny_gguf(tmp_path / "q4_k.gguf", shape, lambda name: "Q4_K" if name.startswith("blk") else "Q8_0")
    llm = LLM(path, dtype="float32", enforce_eager=True, num_kvcache_blocks=16, max_model_len=128)
    model = llm.llm_engine.executor.model
    weights = [m.weight for m in model.modules() if isinstance(getattr(m, "linear_method", None), CPUGGUFLinearMethod)]
    assert len(weights) == 1 + 4 * shape.num_hidden_layers  # the embedding, which is the LM head (tied)
    starts = sorted({w.data_ptr() for w in weights})
    start, end, flags = mapping_of(starts[0])
    assert "hg" in flags and starts[0] % (2 << 20) == 0
    assert all(start <= w.data_ptr() and w.data_ptr() + w.nbytes <= end for w in weights)
    dense = LLM(path, dtype="float32", enforce_eager=True, quantization="dense", num_kvcache_blocks=16,
                max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = [list(range(3, 40))]
    logprobs = [[next(iter(p.values())).logprob for p in out.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs[1:]]
                for out in (llm, dense)]
    # The Q4_K layers' x in 8-bit blocks.
    torch.testing.assert_close(torch.tensor(logprobs[0]), torch.tensor(logprobs[1]), rtol=0, atol=5e-2)


def test_a_row_stride_wider_than_the_blocks_and_bad_input():
    blocks = random_blocks("Q4_0", 8, 64)
    lanes, kind = kernel_blocks(blocks, "Q4_0", 64)
    wide = torch.zeros(8, lanes.shape[1] + 6, dtype=torch.uint8)
    wide[:, :lanes.shape[1]] = lanes
    x = torch.randn(2, 64)
    assert torch.equal(torch.ops.nanovllm_cpu.gguf_linear(x, wide[:, :lanes.shape[1]], kind, None, 16),
                       torch.ops.nanovllm_cpu.gguf_linear(x, lanes, kind, None, 16))
    with pytest.raises(RuntimeError, match="not a multiple"):
        torch.ops.nanovllm_cpu.gguf_linear(torch.randn(1, 48), lanes, kind, None, 16)
    with pytest.raises(RuntimeError, match="GGUF type 10 has no kernel"):
        torch.ops.nanovllm_cpu.gguf_dequantize(blocks, 10, 64)


@requires_default_model
@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight"])
def test_real_tensors_of_the_default_file(name):
    """The embedding (Q8_0, 49152 rows) and Q4_1 layers."""
    from nanovllm.loader.default_model import default_model_path
    from nanovllm.loader.gguf import _read

    info = _read(default_model_path()).tensors[name]
    blocks = torch.from_numpy(info.data.copy())
    qtype, k = info.tensor_type.name, info.shape[1]
    weight = reference_dequantize(blocks, qtype, k)
    assert torch.equal(torch.ops.nanovllm_cpu.gguf_dequantize(blocks, BLOCK_TYPES[qtype], k), weight)
    lanes, kind = kernel_blocks(blocks, qtype, k)
    for x in (torch.randn(4, k), torch.randn(40, k)):  # streamed, tiled
        expected = x @ weight.T  # x in 16-bit blocks: to ~2^-15 of each block's largest value
        torch.testing.assert_close(torch.ops.nanovllm_cpu.gguf_linear(x, lanes, kind, None, 16),
                                   expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_lm_head_logits_are_the_kernels_fp32_sums():
    """bf16 hidden states, fp32 logits, not rounded to bf16 (whose steps at a logit of ~16 are
    1/16: a small model's top tokens then tie)."""
    blocks = random_blocks("Q8_0", 64, 128)
    head = torch.nn.Module()
    hidden = torch.randn(3, 128).bfloat16()
    method = CPUGGUFLinearMethod("Q8_0", torch.bfloat16)
    method.create_weights(head, 128, 64, bias=False)
    head.weight.data.copy_(blocks)
    method.process_weights_after_loading(head)
    logits = method.logits(head, hidden)
    expected = hidden.float() @ reference_dequantize(blocks, "Q8_0", 128).T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert not torch.equal(logits, logits.bfloat16().float())


def test_quantize_at_load_keeps_every_matrix_in_blocks(tmp_path):
    """q8_0 on an fp32 checkpoint: every linear layer and the embedding hold Q8_0 blocks, and the
    next-token distributions stay those of the dense model."""
    path = str(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", hidden_size=64, intermediate_size=128,
                                    head_dim=32))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    prompt = [list(range(3, 40))]
    dense = LLM(path, dtype="float32", num_kvcache_blocks=16, enforce_eager=True)
    quantized = LLM(path, dtype="float32", num_kvcache_blocks=16, enforce_eager=True, quantization="q8_0")
    model = quantized.llm_engine.executor.model
    methods = {type(m.linear_method) for m in model.modules() if hasattr(m, "linear_method")}
    assert methods == {CPUGGUFLinearMethod}
    top = [[min(p, key=lambda t: p[t].rank) if p else None
            for p in llm.generate(prompt, params, use_tqdm=False)[0].prompt_logprobs] for llm in (dense, quantized)]
    agree = sum(a == b for a, b in zip(*top)) / len(top[0])
    assert agree >= 0.9, agree


def test_quantization_values_are_checked(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path, "LlamaForCausalLM"))
    with pytest.raises(ValueError, match="quantization must be one of None, 'dense', 'q8_0', 'q4_0'; got 'int3'"):
        LLM(path, quantization="int3")


@requires_default_model
def test_a_gguf_file_refuses_quantization_at_load():
    with pytest.raises(ValueError, match="GGUF file, already quantized"):
        LLM(quantization="q4_0")


def test_quantized_tensor_shape():
    q = QuantizedTensor.quantize(torch.randn(5, 64), "Q4_0")
    assert (q.blocks.shape[0], q.in_features) == (5, 64) and q.blocks.shape == (5, 36)
