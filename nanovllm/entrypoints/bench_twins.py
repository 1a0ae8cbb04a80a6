"""Random-weight twins of real models for `nanovllm bench --twin SHAPE:TYPE`: files of a real
model's shapes, so speed is measured on realistic files without downloading anything.

Owns the shape table (each model's own config values), writing a twin as an F16 GGUF file that
both nano-vllm and llama.cpp load (seeded normal weights, F32 norms and biases, the metadata
llama.cpp reads, a synthetic byte-level BPE vocabulary of the model's size), quantizing it with
llama.cpp's own quantizer (llama-cpp-python, an optional bench extra), and the cache of both
files under the user cache directory (`bench-twins/<shape>-<TYPE>.gguf`), written atomically so
a second run, or a concurrent one, finds whole files only. The weights mean nothing: a twin's
output is noise, its speed is the real model's.
"""

import argparse
import contextlib
import ctypes
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from nanovllm.cache_paths import user_cache_dir
from nanovllm.entrypoints.bench_llama_cpp import import_llama_cpp


@dataclass(frozen=True)
class TwinShape:
    # GGUF's general.architecture: llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM: q/k/v biases),
    # qwen3 (Qwen3ForCausalLM: q/k norms), gemma3 (Gemma3ForCausalLM: q/k norms, norms after the
    # attention and the MLP too, tanh-GELU, local layers with a sliding window) or qwen3moe
    # (Qwen3MoeForCausalLM: Qwen3's attention, every MLP a mixture of experts)
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None  # of the local layers (gemma3)
    num_experts: int = 0  # qwen3moe: experts a layer, experts a token, an expert's intermediate size
    experts_used: int = 0
    expert_intermediate_size: int = 0

    def active_share(self) -> float:
        """The share of the experts' weights a token reads (1 for a dense model)."""
        return self.experts_used / self.num_experts if self.num_experts else 1.0


# The models' own config.json values, in TwinShape's order: architecture, hidden, intermediate,
# layers, heads, KV heads, head_dim, vocab, rope_theta, rms_norm_eps, context, tied embeddings.
SHAPES = {
    "smollm2-135m": TwinShape("llama", 576, 1536, 30, 9, 3, 64, 49152, 100000.0, 1e-5, 8192, True),
    "smollm2-1.7b": TwinShape("llama", 2048, 8192, 24, 32, 32, 64, 49152, 130000.0, 1e-5, 8192, True),
    "qwen3-0.6b": TwinShape("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, 1000000.0, 1e-6, 40960, True),
    # Llama 3.2's llama3 rope scaling is left out: it changes the rotation, not the speed.
    "llama-3.2-1b": TwinShape("llama", 2048, 8192, 16, 32, 8, 64, 128256, 500000.0, 1e-5, 131072, True),
    "qwen2.5-0.5b": TwinShape("qwen2", 896, 4864, 24, 14, 2, 64, 151936, 1000000.0, 1e-6, 32768, True),
    "gemma-3-1b": TwinShape("gemma3", 1152, 6912, 26, 4, 1, 256, 262144, 1000000.0, 1e-6, 32768, True, 512),
    # Gemma 3 1B's sizes as a plain Llama: what the Gemma family's own ops cost, side by side.
    "gemma-3-1b-as-llama": TwinShape("llama", 1152, 6912, 26, 4, 1, 256, 262144, 1000000.0, 1e-6, 32768, True),
    # A Qwen3-MoE (Qwen3-30B-A3B's design: 128 experts, top-8, 768 wide) sized to these machines:
    # 64 experts of 256 a layer, top-8; 1.7B parameters, 0.3B read a token besides the embedding.
    "qwen3-moe-1.7b-a0.3b": TwinShape("qwen3moe", 1024, 2048, 28, 16, 4, 128, 151936, 1000000.0, 1e-6, 40960,
                                      True, None, 64, 8, 256),
    # The same with one dense MLP as wide as a token's experts together: the dense model of the same
    # active parameters, which a token of the mixture should decode about as fast as.
    "qwen3-moe-1.7b-a0.3b-as-dense": TwinShape("qwen3", 1024, 2048, 28, 16, 4, 128, 151936, 1000000.0, 1e-6,
                                               40960, True),
}
# F16 is the written twin itself; the others are llama.cpp's file types of those names.
TYPES = ("F16", "Q4_K_M", "Q4_0", "Q4_1", "Q8_0", "Q5_K_M", "Q6_K", "Q5_0", "IQ4_NL", "IQ4_XS")
SEED = 0
WEIGHT_STD = 0.02  # the usual initialiser's scale: activations stay finite through every layer
# The quantized file is the same for any thread count; the bench's machines have 2 cores.
QUANTIZE_THREADS = 2
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class Twin:
    shape: str
    qtype: str


def parse_twin(spec: str) -> Twin:
    """`SHAPE:TYPE` (argparse's type for --twin), either unknown name answered with the list."""
    shape, _, qtype = spec.partition(":")
    if shape not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown twin shape {shape!r}; shapes: {', '.join(SHAPES)}")
    if qtype not in TYPES:
        raise argparse.ArgumentTypeError(f"unknown twin type {qtype!r} (SHAPE:TYPE); types: {', '.join(TYPES)}")
    return Twin(shape, qtype)


def twin_path(twin: Twin) -> str:
    return os.path.join(user_cache_dir("bench-twins"), f"{twin.shape}-{twin.qtype}.gguf")


def build_twin(twin: Twin) -> str:
    """The twin's file: from the cache, else written (a quantized type from the shape's F16
    file, itself from the cache or written first) and cached."""
    path = twin_path(twin)
    if os.path.exists(path):
        return path
    if twin.qtype == "F16":
        with _written_atomically(path) as partial:
            write_f16_twin(SHAPES[twin.shape], partial)
        return path
    # Before the F16 file is written: minutes of work that could not be used.
    llama_cpp = import_llama_cpp(f"--twin {twin.shape}:{twin.qtype}")
    f16 = build_twin(Twin(twin.shape, "F16"))
    with _written_atomically(path) as partial:
        quantize(llama_cpp, f16, partial, twin.qtype)
    return path


@contextlib.contextmanager
def _written_atomically(path: str) -> Iterator[str]:
    """A temporary name beside `path`, renamed to it once the block succeeds (removed if not)."""
    print(f"writing {path} (once: later runs reuse it)", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial-{os.getpid()}"
    try:
        yield partial
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def quantize(llama_cpp, source: str, target: str, qtype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = QUANTIZE_THREADS
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"error: llama.cpp could not quantize {source} to {qtype}")


def tensor_shapes(shape: TwinShape) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> its shape as numpy (and Hugging Face) lay it out: [out, in]."""
    hidden, q_rows = shape.hidden_size, shape.num_attention_heads * shape.head_dim
    kv_rows = shape.num_key_value_heads * shape.head_dim
    tensors = {"token_embd.weight": (shape.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not shape.tie_word_embeddings:
        tensors["output.weight"] = (shape.vocab_size, hidden)
    experts, expert_rows = shape.num_experts, shape.expert_intermediate_size
    for i in range(shape.num_hidden_layers):
        layer = {"attn_norm.weight": (hidden,), "attn_q.weight": (q_rows, hidden), "attn_k.weight": (kv_rows, hidden),
                 "attn_v.weight": (kv_rows, hidden), "attn_output.weight": (hidden, q_rows),
                 "ffn_norm.weight": (hidden,)}
        if experts:  # the router, then each projection's experts in one tensor, as llama.cpp stores them
            layer.update({"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_exps.weight": (experts, expert_rows, hidden),
                          "ffn_up_exps.weight": (experts, expert_rows, hidden),
                          "ffn_down_exps.weight": (experts, hidden, expert_rows)})
        else:
            layer.update({"ffn_gate.weight": (shape.intermediate_size, hidden),
                          "ffn_up.weight": (shape.intermediate_size, hidden),
                          "ffn_down.weight": (hidden, shape.intermediate_size)})
        if shape.architecture == "qwen2":
            layer.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        if shape.architecture in ("qwen3", "qwen3moe", "gemma3"):
            layer.update({"attn_q_norm.weight": (shape.head_dim,), "attn_k_norm.weight": (shape.head_dim,)})
        if shape.architecture == "gemma3":
            layer.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
        tensors.update({f"blk.{i}.{name}": dims for name, dims in layer.items()})
    return tensors


def _file_dtype(name: str, dims: tuple[int, ...]) -> np.dtype:
    # Norms, biases and routers stay F32, as llama.cpp's converter keeps them (and its quantizer).
    return np.dtype(np.float32 if len(dims) == 1 or "ffn_gate_inp" in name else np.float16)


def random_tensor(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A twin's tensor `name`: norms all ones, the rest seeded normal values (F32 or F16, as the
    converter would store them)."""
    if "norm" in name:
        return np.ones(dims, dtype=np.float32)
    return (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(_file_dtype(name, dims))


def write_f16_twin(shape: TwinShape, path: str) -> None:
    """Write `shape`'s twin to `path`, one tensor at a time (a whole model in memory at once
    would be twice the file)."""
    writer = twin_writer(shape, path)
    tensors = tensor_shapes(shape)
    for name, dims in tensors.items():
        dtype = _file_dtype(name, dims)
        writer.add_tensor_info(name, dims, dtype, math.prod(dims) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for name, dims in tensors.items():
        writer.write_tensor_data(random_tensor(name, dims, rng))
    writer.close()


def twin_writer(shape: TwinShape, path: str):
    """A gguf.GGUFWriter for `path` holding `shape`'s metadata and vocabulary, as every twin's file
    does; the tensors are the caller's to add."""
    import gguf
    writer = gguf.GGUFWriter(path, shape.architecture)
    _add_model_metadata(writer, shape)
    add_tokenizer(writer, shape.vocab_size)
    return writer


def _add_model_metadata(writer, shape: TwinShape) -> None:
    import gguf
    writer.add_name("random twin")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.head_dim != shape.hidden_size // shape.num_attention_heads:  # readers assume the quotient
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate_size)


def add_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE ("gpt2") vocabulary of exactly `vocab_size` tokens: the 256 byte symbols,
    a space before each letter (gguf-py leaves out an empty merge list, and llama.cpp requires
    one), synthetic fillers, then the end-of-text token, which is also the beginning one."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel
    symbols = sorted(ByteLevel.alphabet())
    merges = [("Ġ", letter) for letter in "abcdefghijklmnopqrstuvwxyz"]
    named = symbols + [a + b for a, b in merges]
    fillers = vocab_size - len(named) - 1
    if fillers < 0:
        raise ValueError(f"a twin's vocabulary needs at least {len(named) + 1} tokens, not {vocab_size}")
    tokens = named + [f"<twin_{i}>" for i in range(fillers)] + [EOS_TOKEN]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
