"""Sampling: the logits processors (unit tests on synthetic logits, statistical with fixed
seeds), seeds across batch compositions, stop strings and ids, min_tokens, logprobs
against transformers, n > 1 sharing prompt blocks, and incremental detokenization."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_tiny_checkpoint, make_tiny_tokenizer
from nanovllm import LLM, SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.sampler import Sampler, SamplingBatch
from nanovllm.engine.stop import StopChecker

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
EOS = 99


def sampling_batch(params: list[SamplingParams], vocab_size: int, prompt=(0,), output_tokens=(),
                   generators=None) -> SamplingBatch:
    """Rows sharing one prompt and output, each banning what its stop checker (EOS = EOS) bans."""
    tokens, n = list(prompt) + list(output_tokens), len(params)
    banned = [StopChecker(p, eos_token_ids={EOS}).banned_token_ids(len(output_tokens)) for p in params]
    return SamplingBatch.build(params, [tokens] * n, [len(prompt)] * n, banned, generators or [None] * n,
                               vocab_size, "cpu")


def draw(params: SamplingParams, rows=4000, logits=None, seed=0, output_tokens=()):
    """Sample `rows` times from the same logits with the given params; returns token ids."""
    logits = PROBS.log() if logits is None else logits
    batch = sampling_batch([params] * rows, logits.numel(), output_tokens=output_tokens)
    out = Sampler()(logits.expand(rows, -1).clone(), batch, torch.Generator().manual_seed(seed))
    return torch.tensor(out.token_ids)


def test_unrestricted_sampling_follows_the_distribution():
    tokens = draw(SamplingParams(temperature=1.0), rows=20000)
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    sigma = (PROBS * (1 - PROBS) / 20000).sqrt()
    assert ((freq - PROBS).abs() < 4 * sigma).all()


def test_temperature_sharpens_and_flattens():
    for temperature in (0.5, 2.0):
        tokens = draw(SamplingParams(temperature=temperature), rows=20000)
        expected = torch.softmax(PROBS.log() / temperature, dim=0)
        freq = torch.bincount(tokens, minlength=5).float() / 20000
        assert ((freq - expected).abs() < 4 * (expected * (1 - expected) / 20000).sqrt()).all()


def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    tokens = draw(SamplingParams(temperature=1.5, top_k=7), logits=logits)
    assert set(tokens.tolist()) == set(logits.topk(7).indices.tolist())


def test_top_p_support_is_the_smallest_set_reaching_p():
    # 0.5 + 0.2 = 0.7 < 0.8, + 0.15 = 0.85 >= 0.8: support {0, 1, 2}, renormalised.
    tokens = draw(SamplingParams(temperature=1.0, top_p=0.8), rows=20000)
    assert set(tokens.tolist()) == {0, 1, 2}
    freq = torch.bincount(tokens, minlength=3).float()[:3] / 20000
    assert torch.allclose(freq, PROBS[:3] / 0.85, atol=0.02)
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.7)).tolist()) == {0, 1}


def test_min_p_threshold_is_relative_to_the_top_token():
    # Threshold 0.25 * 0.5 = 0.125 keeps probabilities 0.5, 0.2, 0.15.
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.25)).tolist()) == {0, 1, 2}


def test_top_k_then_top_p():
    # top_k=2 renormalises {0.5, 0.2} to {0.714, 0.286}; top_p=0.7 then keeps only token 0.
    assert set(draw(SamplingParams(temperature=1.0, top_k=2, top_p=0.7)).tolist()) == {0}


def test_penalties_change_logits_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    batch = sampling_batch([params], 5, prompt=[0, 4], output_tokens=[2, 2, 1])  # token 2 twice, token 1 once
    got = Sampler._penalize(logits, batch)
    # Repetition on prompt tokens {0, 4} and output tokens {1, 2}: positive / 2, negative * 2.
    # Then frequency (0.25 per occurrence) and presence (0.5 once) on output tokens only.
    expected = torch.tensor([[1.0, -2.0 - 0.25 - 0.5, 0.25 - 0.5 - 0.5, 3.0, -4.0]])
    assert torch.allclose(got, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]]))  # input untouched


def test_greedy_and_sampled_rows_share_a_batch():
    logits = torch.tensor([[0.0, 5.0, 0.0], [1.0, 1.0, 1.0]]).repeat(200, 1)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(400)]
    out = Sampler()(logits, sampling_batch(params, 3), torch.Generator().manual_seed(0))
    assert set(out.token_ids[0::2]) == {1}
    assert set(out.token_ids[1::2]) == {0, 1, 2}


def test_greedy_honours_repetition_penalty():
    logits = torch.tensor([3.0, 2.0, 0.0])
    assert draw(SamplingParams(temperature=0.0, repetition_penalty=2.0), rows=1, logits=logits,
                output_tokens=[0]).item() == 1


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((100,), -5.0)
    logits[EOS] = logits[7] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert draw(params, rows=1, logits=logits, output_tokens=[3]).item() not in (EOS, 7)
    assert draw(params, rows=1, logits=logits, output_tokens=[3, 3]).item() in (EOS, 7)


def test_seeded_rows_ignore_batch_composition():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))

    def tokens_for(seeds, engine_seed):
        # A seeded row draws from its own generator, as a seeded sequence does.
        generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        batch = sampling_batch([SamplingParams(temperature=1.0, seed=s) for s in seeds], 50, generators=generators)
        return Sampler()(logits.expand(len(seeds), -1).clone(), batch,
                         torch.Generator().manual_seed(engine_seed)).token_ids

    alone = tokens_for([42], 0)
    assert tokens_for([None, 42, 7], 1)[1] == alone[0]
    assert tokens_for([7, None, None, 42], 2)[3] == alone[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be an integer >= 1, or 0 / -1"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(min_p=1.5), r"min_p must be a number in \[0, 1\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
    (dict(presence_penalty=3), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=-2.5), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(logprobs=-1), r"logprobs must be an integer in \[0, 20\]"),
    (dict(prompt_logprobs=21), r"prompt_logprobs must be an integer in \[0, 20\]"),
    (dict(stop=[""]), "stop must be a non-empty string"),
    (dict(stop_token_ids=[-3]), "stop_token_ids must be a list of non-negative token ids"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
    (dict(seed="x"), "seed must be a 64-bit integer"),
])
def test_invalid_params_say_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop == ["x"]


# ----- incremental detokenization -----

def stream_texts(text: str, params: SamplingParams) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    tokenizer = make_tiny_tokenizer(320)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), params)
    seen, stop = [], None
    for token in tokenizer.encode(text):
        stop = detok.add_token(token, check_stop=True)
        seen.append(detok.output_text(finished=stop is not None))
        if stop:
            break
    return seen, detok, stop


def test_detokenizer_never_emits_broken_utf8():
    text = "héllo wörld, 日本語 ok 🙂!"
    seen, detok, _ = stream_texts(text, SamplingParams())
    assert seen[-1] == text
    assert all("\ufffd" not in s and text.startswith(s) for s in seen)


def test_stop_string_across_tokens_is_cut_and_held_back():
    text = "the cat sat on the mat"
    seen, _, stop = stream_texts(text, SamplingParams(stop=["t on", "zzz"]))
    assert stop == "t on" and seen[-1] == "the cat sa"
    # While running, text that could still grow into "zzz"/"t on" (up to 3 chars) is held back.
    assert all(not s.endswith("t o") for s in seen[:-1])
    seen, _, _ = stream_texts(text, SamplingParams(stop=["t on"], include_stop_str_in_output=True))
    assert seen[-1] == "the cat sat on"


def test_earliest_stop_string_wins():
    _, _, stop = stream_texts("abc def ghi", SamplingParams(stop=["ghi", "c d"]))
    assert stop == "c d"


# ----- through the engine -----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("sampling"), "Qwen3ForCausalLM", max_position_embeddings=512)
    return path, LLM(str(path), dtype="float32", num_kvcache_blocks=64, kvcache_block_size=16)


def test_seeded_request_same_tokens_whatever_the_batch(tiny):
    _, llm = tiny
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4, 5]], [other, seeded, other], use_tqdm=False)
    reordered = llm.generate([[5, 6, 7], [8] * 40], [seeded, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone == reordered[0].outputs[0].token_ids


def test_stop_strings_and_stop_token_ids_end_generation(tiny):
    _, llm = tiny
    prompt = [11, 12, 13, 14]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # A stop string made of the tail of token 3's text and the head of token 4's: spans tokens.
    t3, t4 = tokenizer.decode(free.token_ids[3:4]), tokenizer.decode(free.token_ids[4:5])
    stop = t3[-1:] + t4[:1]
    prefix_len = len(tokenizer.decode(free.token_ids[:3])) + len(t3) - 1
    expected_text = free.text[:free.text.find(stop)]
    assert free.text.find(stop) <= prefix_len
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == expected_text and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop_token_ids=[free.token_ids[5]]), use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(free.token_ids[5])
    assert out.token_ids == free.token_ids[:first + 1] and out.stop_reason == free.token_ids[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=first + 1,
                                                stop_token_ids=[free.token_ids[first]]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1
    assert llm.get_metrics()["num_free_blocks"] == 64


def test_max_tokens_none_runs_to_max_model_len(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=8, max_model_len=40)
    out = llm.generate([[1] * 10], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"


def test_logprobs_match_transformers(tiny):
    path, llm = tiny
    prompt = [3, 30, 31, 32, 33, 200, 201, 17, 18]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + completion.token_ids])).logits[0].float(), dim=-1)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        assert entry[token].rank == 1  # greedy picks the top token
        top = row.topk(3)
        assert [t for t in entry][:3] == top.indices.tolist()
        assert all(math.isclose(entry[t].logprob, v, abs_tol=1e-4) for t, v in zip(top.indices.tolist(), top.values))
    assert math.isclose(completion.cumulative_logprob, sum(e[t].logprob for t, e in
                                                           zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[position], ref[position - 1]
        token = prompt[position]
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1


def test_prompt_logprobs_survive_chunking_and_skip_the_cache(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "Qwen2ForCausalLM", max_position_embeddings=512)
    prompt = list(range(40, 90))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    chunked = LLM(str(path), dtype="float32", num_kvcache_blocks=32, max_num_batched_tokens=7)
    chunked.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # fills the cache
    a = chunked.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    # One 50-token step whose prompt logits are made max_num_seqs (3) rows at a time.
    b = LLM(str(path), dtype="float32", num_kvcache_blocks=32, max_num_seqs=3).generate([prompt], params,
                                                                                        use_tqdm=False)[0]
    assert len(a) == len(prompt)
    assert all(math.isclose(a[i][prompt[i]].logprob, b.prompt_logprobs[i][prompt[i]].logprob, abs_tol=1e-4)
               for i in range(1, len(prompt)))


def test_n_completions_share_the_prompt_blocks(tiny):
    _, llm = tiny
    engine = llm.llm_engine
    prompt = list(range(100, 140))  # 2 full blocks of 16 and a partial one
    request = engine.add_request("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                                ignore_eos=True))
    while not all(seq.block_table for seq in request.seqs):
        engine.step()
    first, *others = request.seqs
    shared = first.block_table[:2]
    assert all(seq.block_table[:2] == shared for seq in others)
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in shared)
    assert len({seq.block_table[2] for seq in request.seqs}) == 3  # each stream owns its partial block
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == 2 + 3
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    [final] = finals
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n_greedy_and_abort(tiny):
    _, llm = tiny
    outs = llm.generate([[7, 8, 9]], SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids
    engine = llm.llm_engine
    engine.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    aborted = engine.abort_request("gone")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_engine_samples_on_its_platforms_ops_and_they_agree_with_the_portable_ones(tiny_checkpoint):
    """On CPU with the kernels the sampler is built on them; their draws are the portable ones'."""
    from nanovllm.kernels import cpu as cpu_kernels
    from nanovllm.layers.sampling_ops import SamplingOps
    from nanovllm.platforms.cpu import KernelSamplingOps
    llm = LLM(str(tiny_checkpoint("LlamaForCausalLM")), dtype="float32", num_kvcache_blocks=16)
    ops = llm.llm_engine.executor.sampler.ops
    assert type(ops) is (KernelSamplingOps if cpu_kernels.has_simd_kernels() else SamplingOps)
    gen = torch.Generator().manual_seed(3)
    logits, uniform = torch.randn(64, 300, generator=gen) * 2, torch.rand(64, generator=gen)
    temperatures = torch.rand(64, generator=gen) + 0.5
    tokens = ops.draw_unfiltered(logits, temperatures, uniform)
    portable = SamplingOps().draw_unfiltered(logits, temperatures, uniform)
    # The same draw to rounding: a uniform within rounding of a boundary could differ (none of these is).
    assert (tokens != portable).sum() <= 1 and tokens.tolist() != [0] * 64
