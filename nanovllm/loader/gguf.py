"""GGUF checkpoints seen through Hugging Face eyes.

Owns everything GGUF-specific: turning GGUF metadata into a `transformers` config, yielding
`(hf_param_name, tensor)` pairs exactly as a Hugging Face checkpoint of the same model would
name and lay them out, and building the tokenizer with the model's end-of-sequence ids. The
rest of the engine never learns that the weights came from GGUF.

A file's header is read by gguf_reader (metadata and tensor views, without the tokenizer's
arrays) once per load (`_read`); tensors the engine keeps in blocks are yielded as the file's
blocks, the others dequantized with gguf-py's vectorized numpy kernels.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from nanovllm.cache_paths import user_cache_dir
from nanovllm.loader.gguf_reader import GGUFHeader, TensorInfo, read_gguf_header
from nanovllm.loader.quantized import BLOCK_TYPES, QuantizedTensor

logger = logging.getLogger(__name__)

# GGUF architecture -> the Hugging Face architecture (model class) its config names. llama.cpp
# writes Mixtral as llama with experts (`_hf_architecture`).
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                  "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
_MIXTRAL = "MixtralForCausalLM"
# The transformers config type of each HF architecture.
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3",
                "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", _MIXTRAL: "mixtral"}
_GEMMA = ("gemma2", "gemma3")

_SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                 "IQ4_NL", "IQ4_XS")
)

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_qkv": "self_attn.qkv_proj",  # stored packed (Phi-3)
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A mixture of experts' block: its router, Qwen2-MoE's shared expert and that expert's gate. Each
# layer's experts are one 3-D tensor a projection ([experts, rows, columns]), one HF tensor an expert.
_MOE_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                    "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_MIXTRAL_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"}
_EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_EXPERT_NAMES = {"mlp.experts": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
                 "block_sparse_moe.experts": {"gate": "w1", "up": "w3", "down": "w2"}}
# Gemma's norms around both blocks: llama.cpp's ffn_norm is its pre-feedforward norm there.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3 stores gate and up packed, as llama.cpp's ffn_up.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
# LongRoPE's factors, which the file stores as tensors: config, not weights.
_ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
# Older Mixtral files store each expert's projections as 2-D tensors of their own.
_LEGACY_EXPERT_NAME = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_LEGACY_EXPERT_PROJECTIONS = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
# llama.cpp's converter stores Gemma's norm weights as 1 + w (ggml multiplies by the weight as it
# is); the reader gives back HF's w, which the model's norms offset again.
_GEMMA_NORM_OFFSET = 1.0
# Which layers slide when the file does not say (`attention.sliding_window_pattern`): every
# n-th layer is global, as llama.cpp sets them.
_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
# Gemma 3's local layers' RoPE base when the file does not say (llama.cpp's fixed value).
_GEMMA3_LOCAL_ROPE_BASE = 10000.0

# Chat-template tokens that end an assistant turn; generation must stop on them even when the
# file's eos id is a different token.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _read(path: str) -> GGUFHeader:
    stat = os.stat(path)
    # Keyed by size and mtime as well, so a file rewritten in place is read afresh.
    return _read_cached(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    return read_gguf_header(path)


def _architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    return arch


def _hf_architecture(meta: dict[str, Any], arch: str) -> str:
    return _MIXTRAL if arch == "llama" and meta.get("llama.expert_count", 0) > 0 else _ARCHITECTURES[arch]


def _rope_parameters(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0)}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        params.update(rope_type=scaling, factor=meta[f"{arch}.rope.scaling.factor"])
        if scaling == "yarn":
            params["original_max_position_embeddings"] = meta[f"{arch}.rope.scaling.original_context_length"]
    elif scaling != "none":
        raise ValueError(f"unsupported GGUF rope scaling type {scaling!r}; supported: none, linear, yarn")
    return params


def load_gguf_config(path: str) -> PretrainedConfig:
    """The Hugging Face config described by the file's metadata.

    A plain `PretrainedConfig` holding every field the models read, with the values LlamaConfig,
    Qwen2Config, Qwen3Config, Gemma2Config, Gemma3TextConfig or Phi3Config would give them (the tests hold it
    to those classes): importing
    those classes pulls in transformers' activations and torch.distributed.tensor, most of a
    warm start's config time (benchmarks/RESULTS.md).
    """
    gguf_file = _read(path)
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    arch = _architecture(meta)
    try:
        return _config(path, meta, tensors, arch)
    except KeyError as e:
        raise ValueError(f"{path}: the file lacks the metadata key or tensor {e}") from e


def transformers_config(config: PretrainedConfig) -> PretrainedConfig:
    """`config` as its architecture's own transformers class (LlamaConfig, ...), for building
    transformers' model of a GGUF file (the benchmark's reference engine, tests)."""
    from transformers import AutoConfig
    model_type = _MODEL_TYPES[config.architectures[0]]
    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}  # the generic class's is ""
    return AutoConfig.for_model(model_type, **fields)


def _config(path: str, meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str) -> PretrainedConfig:
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: llama3-style rope scaling (rope_freqs.weight) is not supported")
    hidden, n_heads = meta[f"{arch}.embedding_length"], meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // n_heads)
    rotary_dims = meta.get(f"{arch}.rope.dimension_count", head_dim)
    layers = meta[f"{arch}.block_count"]
    extra = {"rope_parameters": _rope_parameters(meta, arch)}
    if "rope_factors_long.weight" in tensors:
        extra["rope_parameters"] = _longrope_parameters(meta, tensors, arch)
        extra["original_max_position_embeddings"] = extra["rope_parameters"]["original_max_position_embeddings"]
    if rotary_dims != head_dim:  # where transformers 5 keeps it too: at the top and in the RoPE parameters
        extra["partial_rotary_factor"] = extra["rope_parameters"]["partial_rotary_factor"] = rotary_dims / head_dim
    if arch == "phi3":
        extra["sliding_window"] = meta.get(f"{arch}.attention.sliding_window")
    if arch != "qwen2":  # Qwen2 always has q/k/v biases and no switch for them
        extra["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        extra["mlp_bias"] = False
    extra |= _gemma_fields(meta, arch, hidden, n_heads, head_dim, layers) if arch in _GEMMA else {"hidden_act": "silu"}
    extra |= _moe_fields(meta, arch)
    return PretrainedConfig(
        architectures=[_hf_architecture(meta, arch)],
        # The embedding's row count, not tokenizer metadata, is what the weights must match.
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=meta.get(f"{arch}.feed_forward_length") or meta[f"{arch}.expert_feed_forward_length"],
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", n_heads),
        head_dim=head_dim,
        max_position_embeddings=meta[f"{arch}.context_length"],
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        **extra,
    )


def _moe_fields(meta: dict[str, Any], arch: str) -> dict:
    """A mixture of experts' config fields as llama.cpp reads the file: every layer sparse, softmax
    top-k routing, the weights renormalised where the file says (by default but for Qwen2-MoE, as
    llama.cpp's graphs have it)."""
    experts = meta.get(f"{arch}.expert_count", 0)
    if not experts:
        return {}
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"{arch}.expert_gating_func={gating}: a router scoring other than softmax is not supported")
    if meta.get(f"{arch}.expert_group_count", 0) > 1:
        raise ValueError(f"{arch}.expert_group_count={meta[f'{arch}.expert_group_count']}: grouped top-k routing is "
                         "not supported; the router here is softmax top-k")
    used = meta[f"{arch}.expert_used_count"]
    if arch == "llama":  # Mixtral: the experts' size is the feed-forward length, always renormalised
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    fields = {"num_experts": experts, "num_experts_per_tok": used,
              "moe_intermediate_size": meta[f"{arch}.expert_feed_forward_length"],
              "norm_topk_prob": meta.get(f"{arch}.expert_weights_norm", arch != "qwen2moe"),
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = meta[f"{arch}.expert_shared_feed_forward_length"]
    return fields


def _longrope_parameters(meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str) -> dict[str, Any]:
    """LongRoPE as a Phi-3 file gives it: its short and long factors as tensors."""
    params: dict[str, Any] = {"rope_type": "longrope", "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
                              "original_max_position_embeddings": meta[f"{arch}.rope.scaling.original_context_length"]}
    for name, key in _ROPE_FACTOR_TENSORS.items():
        params[key] = dequantize(tensors[name].data, tensors[name].tensor_type).reshape(-1).tolist()
    if f"{arch}.rope.scaling.attn_factor" in meta:
        params["attention_factor"] = meta[f"{arch}.rope.scaling.attn_factor"]
    return params


def _gemma_fields(meta: dict[str, Any], arch: str, hidden: int, n_heads: int, head_dim: int, layers: int) -> dict:
    """Gemma 2/3's config fields as llama.cpp reads the file: which layers slide (the file's
    pattern, a period or a flag a layer, else the architecture's), the window, softcaps, and
    Gemma 3's RoPE per kind of layer (the local layers' own base)."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _SLIDING_PERIOD[arch])
    sliding = [i % pattern < pattern - 1 for i in range(layers)] if isinstance(pattern, int) else list(pattern)
    fields = {
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp scales q.k by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the 27B models
        # (46 and 62 layers): what their HF configs' query_pre_attn_scalar states.
        "query_pre_attn_scalar": hidden // n_heads if layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim,
        "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": meta.get(f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)}
        fields["rope_parameters"] = {"full_attention": _rope_parameters(meta, arch), "sliding_attention": local}
    return fields


def _layer_names(meta: dict[str, Any], arch: str) -> dict[str, str]:
    if arch in _GEMMA:
        return _GEMMA_LAYER_NAMES
    if arch == "phi3":
        return _PHI3_LAYER_NAMES
    if _hf_architecture(meta, arch) == _MIXTRAL:
        return _MIXTRAL_LAYER_NAMES
    return _MOE_LAYER_NAMES if arch in ("qwen3moe", "qwen2moe") else _LAYER_NAMES


def _hf_names(tensor: TensorInfo, meta: dict[str, Any], arch: str) -> list[str]:
    """The Hugging Face names of a file tensor: one, or for a layer's experts (a 3-D tensor) one
    an expert, in order."""
    match = _TENSOR_NAME.fullmatch(tensor.name)
    layer, base, kind = match.groups() if match else (None, None, None)
    layer_names = _layer_names(meta, arch)
    if match and layer is None and base in _GLOBAL_NAMES:
        return [f"{_GLOBAL_NAMES[base]}.{kind}"]
    if match and layer is not None and base in layer_names:
        return [f"model.layers.{layer}.{layer_names[base]}.{kind}"]
    legacy = _LEGACY_EXPERT_NAME.fullmatch(tensor.name)
    if legacy and layer_names is _MIXTRAL_LAYER_NAMES:
        layer, projection, expert = legacy.groups()
        return [f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_LEGACY_EXPERT_PROJECTIONS[projection]}.weight"]
    if match and layer is not None and base in _EXPERT_TENSORS and kind == "weight" and len(tensor.shape) == 3:
        experts = "block_sparse_moe.experts" if layer_names is _MIXTRAL_LAYER_NAMES else "mlp.experts"
        projection = _EXPERT_NAMES[experts][_EXPERT_TENSORS[base]]
        return [f"model.layers.{layer}.{experts}.{e}.{projection}.weight" for e in range(tensor.shape[0])]
    raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face counterpart")


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's rows from Hugging Face's rotate-half layout (first
    # half of the head dim pairs with the second half) to GGML's interleaved pairs (row 2i with
    # 2i+1): view(heads, 2, d/2).swapaxes(1, 2). This is the inverse: view(heads, d/2, 2).swapaxes.
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_block_types(path: str) -> dict[str, str]:
    """HF name -> GGML type of the file's weight matrices stored in a format the engine can keep
    in blocks (loader/quantized.py)."""
    gguf_file = _read(path)
    meta = gguf_file.metadata
    arch = _architecture(meta)
    return {name: t.tensor_type.name for t in gguf_file.tensors.values()
            if t.tensor_type.name in BLOCK_TYPES and len(t.shape) in (2, 3) and t.name not in _ROPE_FACTOR_TENSORS
            for name in _hf_names(t, meta, arch)}


def iter_gguf_weights(path: str, dtype: torch.dtype = torch.float32,
                      blocks: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield `(hf_param_name, tensor)` for every tensor in the file: those named in `blocks` as
    their file's blocks (QuantizedTensor, which must be of the type given), the rest dequantized
    to `dtype`.

    Names and tensor types are all checked before the first tensor is yielded, so an unsupported
    file fails at once rather than halfway through loading.
    """
    blocks = blocks or {}
    gguf_file = _read(path)
    meta = gguf_file.metadata
    arch = _architecture(meta)
    weights = [t for t in gguf_file.tensors.values() if t.name not in _ROPE_FACTOR_TENSORS]
    for t in weights:
        _hf_names(t, meta, arch)
        if t.tensor_type not in _SUPPORTED_TYPES:
            supported = ", ".join(sorted(q.name for q in _SUPPORTED_TYPES))
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, unsupported; supported: {supported}"
            )
    n_heads = meta.get(f"{arch}.attention.head_count")
    permuted_heads = {"attn_q": n_heads, "attn_k": meta.get(f"{arch}.attention.head_count_kv", n_heads)}
    for t in weights:
        names = _hf_names(t, meta, arch)
        if len(t.shape) == 3:  # a layer's experts: one tensor an expert, each read as a 2-D tensor is
            for e, name in enumerate(names):
                yield name, _tensor(t.name, t.data[e], t.tensor_type, t.shape[1:], blocks.get(name), dtype)
            continue
        name = names[0]
        tensor = _tensor(t.name, t.data, t.tensor_type, t.shape, blocks.get(name), dtype)
        if t.name.endswith("ffn_gate_inp_shexp.weight") and tensor.dim() == 1:  # llama.cpp's [hidden]; HF's [1, hidden]
            tensor = tensor[None]
        base = t.name.split(".")[-2]
        if arch == "llama" and base in permuted_heads:  # qwen2/qwen3 converters do not permute
            if isinstance(tensor, QuantizedTensor):  # whole rows move: blocks move with them
                tensor.blocks = _unpermute_rows(tensor.blocks, permuted_heads[base])
            else:
                tensor = _unpermute_rows(tensor, permuted_heads[base])
        if arch in _GEMMA and name.endswith("norm.weight"):
            tensor = tensor - _GEMMA_NORM_OFFSET
        yield name, tensor


def _tensor(name: str, data, tensor_type: GGMLQuantizationType, shape: tuple[int, ...], block_type: str | None,
            dtype: torch.dtype) -> torch.Tensor | QuantizedTensor:
    """A file tensor's data as its blocks (`block_type`: the type the engine keeps it in, which it
    must be) or dequantized to `dtype`."""
    if block_type is not None:
        if block_type != tensor_type.name:
            raise ValueError(f"GGUF tensor {name!r} is {tensor_type.name}, not {block_type}")
        # A copy: the mapping is read-only, and the weight must not keep the file mapped.
        return QuantizedTensor(torch.from_numpy(np.array(data)), tensor_type.name, shape[1])
    array = dequantize(data, tensor_type).reshape(shape)
    if not array.flags.writeable:  # F32 comes back as a view of the read-only mapping
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from the file's vocabulary, merges and chat template.

    Built through `TokenizersBackend` rather than `AutoTokenizer`: whatever class AutoTokenizer
    picks, the backend it gets from a GGUF file is the one transformers' GGUF converter builds,
    but picking the class first reads the whole file with gguf-py and imports the model's
    config class, most of a first start's tokenizer time (benchmarks/RESULTS.md). Building still
    converts the vocabulary, so the result is saved once in Hugging Face's own format under the
    user's cache directory, keyed by the file (path, size, mtime) and the transformers version,
    and later starts load that. A cache that cannot be written or read is skipped: the
    tokenizer is then built from the file as before.
    """
    path = os.path.abspath(path)
    cached = _tokenizer_cache_dir(path)
    if os.path.isdir(cached):
        try:
            return _load_saved_tokenizer(cached)
        except Exception as e:  # a damaged cache must not stop the engine: rebuild it
            logger.warning("ignoring the cached tokenizer in %s (%s); rebuilding it from %s", cached, e, path)
            shutil.rmtree(cached, ignore_errors=True)
    from transformers import TokenizersBackend

    tokenizer = TokenizersBackend.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _save_tokenizer(tokenizer, cached)
    return tokenizer


def _load_saved_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """What AutoTokenizer.from_pretrained(directory) returns, through the class the directory
    names, without importing AutoTokenizer's registry of every model."""
    import transformers

    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        class_name = json.load(f)["tokenizer_class"]
    return getattr(transformers, class_name).from_pretrained(directory)


def _tokenizer_cache_dir(path: str) -> str:
    import transformers

    stat = os.stat(path)
    key = f"{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return os.path.join(user_cache_dir("gguf-tokenizers"), hashlib.sha256(key.encode()).hexdigest()[:16])


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, target: str) -> None:
    """Save into a fresh directory beside `target`, then rename it into place, so no reader ever
    sees half a tokenizer; if another process got there first, its copy stays."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".partial-")
        tokenizer.save_pretrained(tmp)
        _record_added_tokens(tokenizer, tmp)
        os.rename(tmp, target)
    except OSError as e:  # read-only home, a full disk, or a concurrent save that won
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(target):
            logger.info("could not cache the GGUF tokenizer in %s (%s)", target, e)


def _record_added_tokens(tokenizer: PreTrainedTokenizerBase, directory: str) -> None:
    """List the added tokens in the saved tokenizer_config.json, as Hub repositories do: without
    them there, every load json-parses the whole tokenizer.json in Python just to find them,
    besides the Rust backend's own parse of it."""
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    # Each token as transformers' own save_pretrained serializes it (before dropping the list
    # for a TokenizersBackend).
    config["added_tokens_decoder"] = {str(index): token.__getstate__()
                                      for index, token in tokenizer.added_tokens_decoder.items()}
    with open(path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def gguf_eos_token_ids(path: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end generation: the file's eos/eot/eom ids, plus any end-of-turn token the chat
    template emits (e.g. `<|im_end|>`), in that order without repeats."""
    meta = _read(path).metadata
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [meta[k] for k in keys if k in meta]
    template = meta.get("tokenizer.chat_template") or tokenizer.chat_template or ""
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in _END_OF_TURN_TOKENS if token in template and token in vocab]
    return list(dict.fromkeys(ids))
