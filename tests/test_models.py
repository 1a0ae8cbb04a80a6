"""Model classes + loaders against transformers on tiny random checkpoints.

Attention runs through a test-only dense causal backend (conftest's our_logits: one sequence,
no KV cache), so these tests pin the model graph and the weight mapping, not the paged attention
kernels.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import family_config, hf_logits, make_tiny_checkpoint, make_tiny_config, our_logits
from nanovllm.distributed.parallel_state import SINGLE, TPGroup
from nanovllm.loader.safetensors import iter_safetensors, safetensors_files
from nanovllm.loader.weights import load_weights
from nanovllm.models.registry import get_model_class, supported_architectures


def build(path, tp_group: TPGroup = SINGLE):
    config = AutoConfig.from_pretrained(path)
    model = get_model_class(config)(config, tp_group)
    load_weights(model, iter_safetensors(path))
    return model


CASES = {
    "qwen3_head_dim_ne_hidden_over_heads": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_tied": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen2_bias": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "llama_9q_3kv": ("LlamaForCausalLM", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3)),
    "llama_biases_llama3_rope_tied": ("LlamaForCausalLM", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "mistral": ("MistralForCausalLM", dict()),
    "mistral_sliding_window": ("MistralForCausalLM", dict(sliding_window=7)),
    "qwen2_sliding_window_past_max_window_layers": ("Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=7, max_window_layers=1)),
    # Prompts within the original context (transformers moves every position of a longer sequence
    # to the long factors; test_layers holds each range's rotation to transformers').
    "phi3_longrope_window": ("Phi3ForCausalLM", dict(
        original_max_position_embeddings=32, sliding_window=7,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0] * 2,
                         "long_factor": [2.0, 3.0, 5.0, 8.0] * 2})),
    "phi4_mini_partial_rotary_tied": family_config("phi4-mini", None, original_context=32, tie_word_embeddings=True),
    "gemma2": family_config("gemma2", 7, tie_word_embeddings=True),
    "gemma3": family_config("gemma3", 7),
    "qwen3_moe_a_dense_layer": family_config("qwen3-moe", None, mlp_only_layers=[1]),
    "qwen2_moe_shared_expert": family_config("qwen2-moe", None),
    "mixtral_sliding_window": family_config("mixtral", 7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tiny_checkpoint):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    input_ids = torch.randint(0, 320, (24,))
    ours = our_logits(build(path), input_ids)
    assert ours.shape == (24, 320)
    torch.testing.assert_close(ours, hf_logits(path, input_ids), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM", head_dim=32)


def fresh_model(path):
    config = AutoConfig.from_pretrained(path)
    return get_model_class(config)(config, SINGLE)


def test_missing_tensor_names_the_packed_shard(qwen3_path):
    weights = [(n, t) for n, t in iter_safetensors(qwen3_path) if n != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing parameters \['model\.layers\.1\.mlp\.gate_up_proj\.weight \(shard 1\)'\]"):
        load_weights(fresh_model(qwen3_path), weights)


def test_missing_plain_tensor(qwen3_path):
    weights = [(n, t) for n, t in iter_safetensors(qwen3_path) if n != "model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing parameters \['model\.norm\.weight'\]"):
        load_weights(fresh_model(qwen3_path), weights)


def test_extra_tensor_is_named(qwen3_path):
    weights = [*iter_safetensors(qwen3_path), ("model.layers.0.self_attn.extra.weight", torch.zeros(1))]
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.extra\.weight'\]"):
        load_weights(fresh_model(qwen3_path), weights)


def test_duplicate_and_misshapen_tensors_are_named(qwen3_path):
    weights = list(iter_safetensors(qwen3_path))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight loaded twice"):
        load_weights(fresh_model(qwen3_path), weights + [w for w in weights if w[0].endswith("0.self_attn.k_proj.weight")])
    bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in weights]
    with pytest.raises(ValueError, match="model.norm.weight.*expected shape"):
        load_weights(fresh_model(qwen3_path), bad)


def test_tied_model_accepts_and_skips_lm_head(tiny_checkpoint):
    path = tiny_checkpoint("Qwen3ForCausalLM", tie_word_embeddings=True)
    weights = dict(iter_safetensors(path))
    assert "lm_head.weight" not in weights
    model = fresh_model(path)
    load_weights(model, [*weights.items(), ("lm_head.weight", weights["model.embed_tokens.weight"])])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_model_requires_lm_head(qwen3_path):
    weights = [(n, t) for n, t in iter_safetensors(qwen3_path) if n != "lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing parameters \['lm_head\.weight'\]"):
        load_weights(fresh_model(qwen3_path), weights)


def test_unknown_architecture_lists_supported(qwen3_path):
    config = AutoConfig.from_pretrained(qwen3_path)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*" + ", ".join(supported_architectures())):
        get_model_class(config)


@pytest.mark.parametrize("arch,overrides,message", [
    ("MistralForCausalLM", dict(sliding_window=0), "sliding_window=0 must be at least 1"),
    ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention", "chunked_attention"]),
     "layer_types=.*'chunked_attention'.*expected 2 entries of 'full_attention' or 'sliding_attention'"),
    ("LlamaForCausalLM", dict(hidden_act="relu"), "hidden activation 'relu' is not supported; supported: silu, "
                                                  "gelu_pytorch_tanh"),
])
def test_a_description_the_decoder_cannot_build_is_named(arch, overrides, message):
    config = make_tiny_config(arch, **overrides)
    with pytest.raises(ValueError, match=message):
        get_model_class(config)(config, SINGLE)


def test_intermediate_size_not_divisible_by_tp():
    config = make_tiny_config("LlamaForCausalLM", intermediate_size=129)
    with pytest.raises(ValueError, match="intermediate_size=129"):
        get_model_class(config)(config, TPGroup(0, 2))


def test_sharded_checkpoint_via_index(qwen3_path, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(safetensors_files(tmp_path)) > 1
    (tmp_path / "consolidated.safetensors").write_bytes((qwen3_path / "model.safetensors").read_bytes())
    assert {n for n, _ in iter_safetensors(tmp_path)} == {n for n, _ in iter_safetensors(qwen3_path)}


def test_pickle_only_directory_is_refused(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors are required"):
        list(iter_safetensors(tmp_path))


def _tp_worker(rank: int, world_size: int, port: int, path: str, input_ids: torch.Tensor, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        logits = our_logits(build(path, TPGroup(rank, world_size, dist.group.WORLD)), input_ids)
        assert (logits is None) == (rank != 0)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown, as the engine's workers do: gloo's thread may still be letting
    # go of the last gather's tensors, which takes the GIL, and during finalization that aborts
    # the process (seen once, on rank 1).
    os._exit(0)


def test_tensor_parallel_matches_transformers(tiny_checkpoint, tmp_path):
    # tp=2 over real gloo collectives: one KV head (replicated on both ranks) and an odd
    # vocabulary (a padded shard), against the unsharded HF model.
    path = tiny_checkpoint("Qwen3ForCausalLM", head_dim=32, num_key_value_heads=1, vocab_size=321)
    input_ids = torch.randint(0, 321, (16,))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "logits.pt"
    mp.spawn(_tp_worker, args=(2, port, str(path), input_ids, str(out)), nprocs=2)
    torch.testing.assert_close(torch.load(out), hf_logits(path, input_ids), atol=1e-4, rtol=1e-4)
