"""End to end: greedy tokens identical to transformers in fp32, whatever the batching,
chunking, prefix caching or preemption; bf16 close to it; metrics; and each bad input
rejected up front.

Parity tests run on NANOVLLM_TEST_DEVICE (default: CUDA when available, else CPU), with
transformers on the same device.
"""

import json
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import family_config, make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.config import NUM_THREADS_ENV, EngineConfig, usable_cpus

MAX_TOKENS = 12
BLOCK = 16
# Lengths around block boundaries, plus a long one that spans many blocks and chunks.
PROMPT_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 300]

DEVICE = os.environ.get("NANOVLLM_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

ARCHS = {
    "qwen3-head-dim": ("Qwen3ForCausalLM", dict(head_dim=24)),  # head_dim != hidden / heads
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "llama-9q-3kv": ("LlamaForCausalLM", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3)),
    "llama-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True)),
    # Sliding windows of 20, shorter than most prompts, starting mid-block; Phi's prompts within
    # its original context (512).
    "mistral-window": family_config("mistral", 20),
    "gemma2": family_config("gemma2", 20),
    "phi4-mini-window": family_config("phi4-mini", 20),
    "gemma3": family_config("gemma3", 20),
    # Mixtures of experts: a dense layer beside a sparse one; a shared expert; Mixtral's window.
    "qwen3-moe": family_config("qwen3-moe", None, mlp_only_layers=[1]),
    "qwen2-moe": family_config("qwen2-moe", None),
    "mixtral-window": family_config("mixtral", 20),
}


def random_prompts(lengths, vocab=300, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path, prompts, max_tokens=MAX_TOKENS):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    for p in prompts:
        # An explicit mask: without one, generate masks every token equal to pad_token_id.
        prompt = torch.tensor([p], device=DEVICE)
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def greedy(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = ARCHS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch,
                                max_position_embeddings=512, **overrides)
    prompts = random_prompts(PROMPT_LENGTHS)
    return path, prompts, hf_greedy(path, prompts)


def test_greedy_matches_transformers(checkpoint):
    path, prompts, expected = checkpoint
    llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=256)
    assert greedy(llm, prompts) == expected
    metrics = llm.get_metrics()
    assert metrics["num_free_blocks"] == metrics["num_kvcache_blocks"] == 256
    assert metrics["prompt_tokens"] == sum(PROMPT_LENGTHS)
    assert metrics["generation_tokens"] == MAX_TOKENS * len(prompts)


@pytest.mark.parametrize("settings", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),  # every prompt but the shortest is chunked
    dict(max_num_seqs=2),
])
def test_same_tokens_under_other_scheduling(checkpoint, settings):
    path, prompts, expected = checkpoint
    llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=256, kvcache_block_size=BLOCK,
              **settings)
    assert greedy(llm, prompts) == expected


def test_preemption_recomputes_to_the_same_tokens(checkpoint):
    path, prompts, expected = checkpoint
    # The short prompts take 13 blocks when admitted together and grow to need 17.
    llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=14, max_model_len=64)
    assert greedy(llm, prompts[:-1]) == expected[:-1]
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["num_free_blocks"] == 14


def test_shared_prefixes_hit_the_cache_and_match(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", max_position_embeddings=512)
    rng = random.Random(1)
    prefix = [rng.randrange(300) for _ in range(40)]
    prompts = [prefix + [rng.randrange(300) for _ in range(n)] for n in (1, 5, 20)]
    exact = [rng.randrange(300) for _ in range(3 * BLOCK)]  # exactly 3 blocks
    prompts += [exact, exact]
    expected = hf_greedy(path, prompts)
    llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=64, kvcache_block_size=BLOCK)
    # One at a time, so later prompts find the earlier ones' blocks published.
    assert [greedy(llm, [p])[0] for p in prompts] == expected
    # 2 full prefix blocks for each of the 2 later shared-prefix prompts, 2 of the 3 exact blocks.
    assert llm.get_metrics()["prefix_cache_hit_tokens"] == 2 * 2 * BLOCK + 2 * BLOCK
    assert llm.get_metrics()["num_free_blocks"] == 64


def test_mixed_batch_decodes_while_long_prompt_prefills(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM", max_position_embeddings=512)
    prompts = random_prompts([3, 4, 400, 5], seed=3)
    expected = hf_greedy(path, prompts, max_tokens=20)
    llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=128, max_num_batched_tokens=32)
    assert greedy(llm, prompts, max_tokens=20) == expected


def test_bf16_stays_close_to_transformers_fp32(tmp_path):
    """bf16 (the GPU default) cannot match fp32 token for token; scored by fp32 transformers
    on the engine's own output, its log-probabilities agree to within bf16 rounding."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", max_position_embeddings=512)
    prompts = random_prompts([5, 40, 130], seed=4)
    llm = LLM(str(path), dtype="bfloat16", device=DEVICE, num_kvcache_blocks=64, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device=DEVICE)).logits[0, len(prompt) - 1:-1]
        reference = torch.log_softmax(logits.float().cpu(), -1)[torch.arange(len(tokens)), tokens]
        ours = torch.tensor([position[token].logprob for position, token in zip(out.outputs[0].logprobs, tokens)])
        assert (ours - reference).abs().max() < 0.1


def test_prompt_forms_and_order(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=32)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("hello world")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    forms = ["hello world", ids, {"prompt_token_ids": ids}, {"prompt": "hello world"}]
    outs = llm.generate(forms, params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids and o.finished for o in outs)
    assert outs[0].prompt == "hello world" and outs[1].prompt is None
    assert outs[0].outputs[0].text == tokenizer.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    assert outs[0].outputs[0].finish_reason == "length"
    single = llm.generate(ids, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    per_prompt = llm.generate([ids, ids], [params, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)],
                              use_tqdm=False)
    # Each prompt under its own parameters, in order: the second stops at its 2 greedy tokens.
    assert [o.outputs[0].token_ids for o in per_prompt] == [outs[0].outputs[0].token_ids,
                                                            outs[0].outputs[0].token_ids[:2]]


def test_eos_stops_generation(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    prompt = random_prompts([10], seed=5)[0]
    free_run = LLM(str(path), dtype="float32", num_kvcache_blocks=32)
    tokens = greedy(free_run, [prompt])[0]
    # Declare the 4th generated token an EOS id through generation_config.json.
    with open(path / "generation_config.json") as f:
        gen = json.load(f)
    gen["eos_token_id"] = [tokens[3]]
    with open(path / "generation_config.json", "w") as f:
        json.dump(gen, f)
    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=32)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    first = tokens.index(tokens[3])
    assert out.outputs[0].token_ids == tokens[:first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_sampling_is_seeded_and_mixes_with_greedy(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    prompts = random_prompts([5, 9], seed=7)
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    runs = []
    for _ in range(2):
        llm = LLM(str(path), dtype="float32", num_kvcache_blocks=32, seed=3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert runs[0][1] == greedy(llm, [prompts[1]], max_tokens=8)[0]


class TestBadInput:
    @pytest.fixture(scope="class")
    def llm(self, tmp_path_factory):
        path = make_tiny_checkpoint(tmp_path_factory.mktemp("bad"), "Qwen3ForCausalLM")
        return LLM(str(path), dtype="float32", num_kvcache_blocks=32, max_model_len=64)

    @pytest.mark.parametrize("prompt, message", [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 320], r"\[0, 320\)"),
        ([1, -1], r"\[0, 320\)"),
        ({"text": "hi"}, "'prompt' or 'prompt_token_ids'"),
        ([1] * 60, "60 tokens.*max_tokens \\(16\\).*max_model_len=64"),
    ])
    def test_bad_prompt(self, llm, prompt, message):
        with pytest.raises(ValueError, match=message):
            llm.generate([[1, 2, 3], prompt], use_tqdm=False)
        # Nothing half-done: the valid prompt in the same call was not queued either.
        assert not llm.llm_engine.has_unfinished()
        assert llm.get_metrics()["num_free_blocks"] == 32

    @pytest.mark.parametrize("kwargs, message", [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-0.5), "temperature must be a number >= 0"),
    ])
    def test_bad_sampling_params(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)

    def test_sampling_params_count_must_match(self, llm):
        with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
            llm.generate([[1]], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_bad_engine_arguments(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ok", "Qwen3ForCausalLM")
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(path), max_num_sequences=4)
    with pytest.raises(FileNotFoundError, match="model not found"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed config.json"):
        LLM(str(broken))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        LLM(str(path), dtype="float32", num_kvcache_blocks=32)


def test_bad_dtype_device_and_cache_size(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(path, dtype="float8")
    with pytest.raises(ValueError, match="float16' is not supported on CPU"):
        LLM(path, dtype="float16", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            LLM(path, device="cuda")
    with pytest.raises(ValueError, match=r"needs 16 blocks \(.* GiB\)"):
        LLM(path, dtype="float32", num_kvcache_blocks=4, max_model_len=256)


def test_cpu_threads_come_from_the_option_the_environment_or_the_usable_cpus(tmp_path, monkeypatch):
    path = str(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM"))
    threads = torch.get_num_threads()
    monkeypatch.delenv(NUM_THREADS_ENV, raising=False)
    try:
        assert EngineConfig(path).num_threads == usable_cpus() <= len(os.sched_getaffinity(0))
        monkeypatch.setenv(NUM_THREADS_ENV, "3")
        assert EngineConfig(path).num_threads == 3
        assert EngineConfig(path, num_threads=1).num_threads == 1  # the option wins
        LLM(path, dtype="float32", num_kvcache_blocks=32)
        assert torch.get_num_threads() == 3
        for bad in ("0", "two"):
            monkeypatch.setenv(NUM_THREADS_ENV, bad)
            with pytest.raises(ValueError, match=f"{NUM_THREADS_ENV} must be an integer >= 1, got '{bad}'"):
                EngineConfig(path)
        with pytest.raises(ValueError, match="num_threads must be an integer >= 1, got 0"):
            EngineConfig(path, num_threads=0)
    finally:
        torch.set_num_threads(threads)


def test_a_model_whose_every_layer_slides_frees_the_blocks_behind_its_window(tmp_path):
    """Mistral-style (every layer a window of 20): four prompts of 300 tokens, which whole would
    need 20 blocks each, run side by side in a pool of 32 without a preemption, since each holds
    only the blocks its window still sees, and give transformers' tokens. A model with global
    layers (Gemma 3) keeps every block."""
    arch, overrides = family_config("mistral", 20, max_position_embeddings=512)
    path = make_tiny_checkpoint(tmp_path / "mistral", arch, **overrides)
    prompts = random_prompts([300] * 4, seed=3)
    llm = LLM(str(path), dtype="float32", device=DEVICE, num_kvcache_blocks=32, max_model_len=512,
              max_num_batched_tokens=64)
    assert llm.llm_engine.block_manager.sliding_window == 20
    assert greedy(llm, prompts) == hf_greedy(path, prompts)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] == 0 and metrics["num_free_blocks"] == 32
    arch, overrides = family_config("gemma3", 20)
    gemma = make_tiny_checkpoint(tmp_path / "gemma", arch, **overrides)
    assert LLM(str(gemma), dtype="float32", device=DEVICE, num_kvcache_blocks=32).llm_engine.block_manager.sliding_window is None
