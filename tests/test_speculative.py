"""Speculative decoding: the n-gram and suffix proposers on token lists, the config's checks, and
the engine with and without speculation (n-gram, suffix, a draft model) on a tiny random
checkpoint (fp32): the same greedy tokens and logprobs, the same seeded text, the target's
distribution unseeded, stops and limits kept, no block leaked (the draft model's own included),
with chunked prompts, prefix caching and preemption; a request's own draft limit."""

from collections import Counter

import pytest

from conftest import make_tiny_checkpoint, requires_default_model
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.draft_model import DraftModel
from nanovllm.speculative.config import SpeculativeConfig
from nanovllm.speculative.ngram import NgramProposer
from nanovllm.speculative.suffix import SuffixProposer


def test_ngram_drafts_what_followed_the_longest_earlier_match():
    proposer = NgramProposer(min_n=2, max_n=4, num_tokens=3)
    assert proposer.propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    # The longest n wins: [7, 2, 3] matched earlier by its last 3 tokens, not just [2, 3].
    assert proposer.propose([2, 3, 8, 8, 7, 2, 3, 6, 6, 0, 7, 2, 3]) == [6, 6, 0]
    assert proposer.propose([1, 2, 3, 4, 5, 9, 7, 8]) == []  # [9, 7, 8] / [7, 8] never occurred before
    assert proposer.propose([1, 2, 3, 4, 1, 2], max_tokens=1) == [3]
    assert proposer.propose([1, 2]) == []  # too short to hold a match and its continuation


def test_ngram_prefers_an_occurrence_with_a_whole_draft():
    proposer = NgramProposer(min_n=1, max_n=2, num_tokens=3)
    # The latest [5, 5] is followed by one token only: the one before it gives a whole draft.
    assert proposer.propose([5, 5, 5, 5, 5]) == [5, 5, 5]


def test_suffix_drafts_the_most_frequent_continuation_of_the_longest_match():
    proposer = SuffixProposer(num_tokens=8, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1,
                              max_cached_requests=10)
    assert proposer.propose([1, 2, 3, 4, 5, 6, 7, 50, 1, 2, 3]) == [4, 5, 6]  # as long as the 3-token match
    # After [1, 2]: 3 twice, 9 once -> 3; then [1, 2, 3] continues with 4 once, 5 once.
    frequent = SuffixProposer(num_tokens=1, max_depth=24, max_spec_factor=4.0, min_token_prob=0.1,
                              max_cached_requests=10)
    assert frequent.propose([1, 2, 3, 0, 1, 2, 9, 0, 1, 2, 3, 7, 1, 2]) == [3]


def test_suffix_stops_where_the_continuation_becomes_unlikely():
    proposer = SuffixProposer(num_tokens=8, max_depth=24, max_spec_factor=8.0, min_token_prob=0.5,
                              max_cached_requests=10)
    # [4] was followed by 5, 6, 7 and 8 once each: no continuation holds half the mass.
    assert proposer.propose([4, 5, 1, 4, 6, 1, 4, 7, 1, 4, 8, 1, 4]) == []
    assert proposer.propose([4, 5, 1, 4, 5, 1, 4, 5, 2, 4]) == [5, 1, 4, 5]


def test_suffix_searches_the_cache_of_finished_outputs():
    proposer = SuffixProposer(num_tokens=8, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1,
                              max_cached_requests=2)
    proposer.finish([20, 21, 22, 23, 24, 25])
    assert proposer.propose([99, 20, 21, 22]) == [23, 24, 25]
    proposer.finish([30, 31])
    proposer.finish([40, 41])  # the first output leaves the cache
    assert proposer.propose([99, 20, 21, 22]) == []
    # A match never runs across two cached outputs.
    assert proposer.propose([31, 40]) == [41]


def test_the_output_cache_index_follows_additions_and_evictions():
    """Positions are appended as outputs come and skipped once evicted; compaction keeps them true."""
    import random

    from nanovllm.speculative.suffix import OutputCache
    rng, cache, kept = random.Random(0), OutputCache(max_requests=5), []
    for _ in range(300):
        output = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        cache.add(output)
        kept = (kept + [output])[-5:]
        tokens = cache.tokens
        assert len(tokens) < 2 * sum(len(o) + 1 for o in kept)  # evicted tokens do not pile up
        for token in range(6):
            positions = cache.positions_of(token)
            assert (tokens[positions] == token).all() and (positions >= cache.start).all()
            assert len(positions) == sum(o.count(token) for o in kept)


@pytest.mark.parametrize("given, message", [
    ({"method": "beam"}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 64]"),
    ({"method": "suffix", "num_speculative_tokens": 65}, "[1, 64]"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "unknown fields ['lookahead']"),
    ({"model": "path/to/draft"}, "num_speculative_tokens is required for method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "model names the draft model"),
    ({"method": "ngram", "model": "path/to/draft", "num_speculative_tokens": 4}, "model names the draft model"),
    ({"model": "d", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
    ({"method": "suffix", "quantization": "q8_0"}, "applies to method 'draft_model' only"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob"),
])
def test_bad_configs_say_what_is_allowed(given, message):
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.of(given)
    assert message in str(error.value)


def test_config_defaults():
    ngram = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (2, 5)
    assert isinstance(ngram.proposer(), NgramProposer)
    suffix = SpeculativeConfig.of({"method": "suffix"})
    assert suffix.num_speculative_tokens == 24 and isinstance(suffix.proposer(), SuffixProposer)
    draft = SpeculativeConfig.of({"model": "path/to/draft", "num_speculative_tokens": 4})  # as vLLM infers it
    assert draft.method == "draft_model" and draft.proposer() is None


def test_a_draft_model_that_cannot_be_opened_or_has_another_tokenizer_is_refused(spec_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model '/no/such/draft'"):
        LLM(str(spec_checkpoint), speculative_config={"model": "/no/such/draft", "num_speculative_tokens": 3})
    other = make_tiny_checkpoint(tmp_path / "other-vocab", vocab_size=400)
    with pytest.raises(ValueError, match="has another tokenizer than the target model"):
        LLM(str(spec_checkpoint), dtype="float32", speculative_config={"model": str(other),
                                                                       "num_speculative_tokens": 3})


# ----- the engine, with and without speculation -----

SPEC_METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                "suffix": {"method": "suffix", "num_speculative_tokens": 6},
                # Its model is the target's own checkpoint (_config), whose drafts a greedy target accepts.
                "draft_model": {"method": "draft_model", "num_speculative_tokens": 4}}


def _config(method: str, checkpoint) -> dict:
    """SPEC_METHODS[method], with the target itself as the draft model where it takes one."""
    config = SPEC_METHODS[method]
    return {**config, "model": str(checkpoint)} if method == "draft_model" else config
# A repeating prompt gives the n-gram and suffix proposers matches from the first step; a tiny
# random model's greedy output soon loops too, which the drafts then follow.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [40, 41, 42, 43] * 6 + [44], list(range(100, 130)),
           [7, 3] * 10 + [200, 201, 202]]


@pytest.fixture(scope="module")
def spec_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec-ckpt"))


def _run(checkpoint, params, speculative_config=None, prompts=PROMPTS, **engine) -> tuple[list, LLM]:
    llm = LLM(str(checkpoint), dtype="float32", speculative_config=speculative_config,
              **{"num_kvcache_blocks": 64, **engine})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    manager = llm.llm_engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing leaked, drafts' blocks included
    manager.check_invariants([])
    draft_model = llm.llm_engine.speculation and llm.llm_engine.speculation.drafter
    if isinstance(draft_model, DraftModel):  # the draft's own KV cache too, no larger than the target's
        assert draft_model.block_manager.num_blocks == manager.num_blocks
        draft_blocks = draft_model.block_manager
        assert not draft_model.shadows and draft_blocks.num_free_blocks == draft_blocks.num_blocks
        draft_model.block_manager.check_invariants([])
    return [(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outputs for c in o.outputs], llm


def _spec_metrics(llm: LLM) -> tuple[int, int]:
    m = llm.get_metrics()
    return m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("method", SPEC_METHODS)
@pytest.mark.parametrize("engine", [
    {},  # plain
    {"max_num_batched_tokens": 9, "enable_prefix_caching": True},  # chunked prompts, drafts cut by the budget
    {"num_kvcache_blocks": 24, "kvcache_block_size": 4, "max_model_len": 80},  # preemption by recompute
], ids=["plain", "chunked", "preempted"])
def test_greedy_tokens_are_the_same_with_speculation(spec_checkpoint, method, engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    expected, _ = _run(spec_checkpoint, params, **engine)
    got, llm = _run(spec_checkpoint, params, _config(method, spec_checkpoint), **engine)
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    for (*_, got_logprobs), (*_, expected_logprobs) in zip(got, expected):
        for g, e in zip(got_logprobs, expected_logprobs):
            assert g.keys() == e.keys()
            assert all(g[t].logprob == pytest.approx(e[t].logprob, abs=1e-4) for t in g)
    drafted, accepted = _spec_metrics(llm)
    assert drafted > 0 and accepted > 0  # speculation took part
    if engine.get("num_kvcache_blocks") == 24:
        assert llm.get_metrics()["num_preemptions"] > 0


def test_stop_strings_max_tokens_and_min_tokens_hold(spec_checkpoint):
    plain, llm = _run(spec_checkpoint, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    stop = tokenizer.decode(plain[0][0][20:22])  # text the first output writes mid-way
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25),
              SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[plain[3][0][9]])]
    expected, _ = _run(spec_checkpoint, params)
    got, _ = _run(spec_checkpoint, params, SPEC_METHODS["ngram"])
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    assert got[0][2] == "stop" and len(got[1][0]) == 7


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_a_seeded_request_writes_the_same_text_with_and_without_speculation(spec_checkpoint, method):
    """Each emitted token takes the draw it would take without speculation, so a seed gives
    the same text: the output distribution is the target's, draw for draw."""
    params = [SamplingParams(temperature=0.5, top_k=4, top_p=0.95, seed=seed, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.05) for seed in range(len(PROMPTS))]
    expected, _ = _run(spec_checkpoint, params)
    got, llm = _run(spec_checkpoint, params, _config(method, spec_checkpoint))
    again, _ = _run(spec_checkpoint, params, _config(method, spec_checkpoint))
    assert [g[:3] for g in got] == [e[:3] for e in expected] == [a[:3] for a in again]
    assert _spec_metrics(llm)[1] > 0


@requires_default_model
def test_unseeded_sampling_keeps_the_targets_distribution():
    """Without a seed, draws come from the engine's stream in another order: on a real model
    copying a list (drafts often accepted), the frequencies of the next tokens over many
    requests match those without speculation within sampling noise."""
    messages = [{"role": "user", "content": "Repeat this list: apples, pears, plums, figs, dates, limes, kiwis."},
                {"role": "assistant", "content": "apples, pears,"}]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    samples, runs = 400, []
    for config in (None, {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": samples}):
        llm = LLM(max_model_len=256, speculative_config=config, seed=3)
        tokenizer = llm.get_tokenizer()
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        outs = llm.generate([prompt] * samples, params, use_tqdm=False)
        runs.append((Counter(tuple(o.outputs[0].token_ids) for o in outs), llm.get_metrics()))
    (plain, _), (spec, metrics) = runs
    assert metrics["spec_decode_num_accepted_tokens"] > samples  # speculation took part throughout
    for outcome, count in plain.most_common(3):
        f_plain, f_spec = count / samples, spec[outcome] / samples
        sigma = (2 * f_plain * (1 - f_plain) / samples) ** 0.5
        assert abs(f_spec - f_plain) < 4 * sigma + 1e-9, (outcome, f_plain, f_spec)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_speculate_within_their_grammar(spec_checkpoint, method):
    """A draft is cut where the grammar rejects it and its rows are masked as the grammar stands
    there: the same outputs, which hold to their constraints, and drafts accepted for them."""
    repeat = StructuredOutputsParams(regex="(abc){12}")  # a repeating text the drafts can follow
    constrained = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=repeat),
                   SamplingParams(temperature=0.8, seed=1, max_tokens=60, structured_outputs=repeat),
                   SamplingParams(temperature=0.0, max_tokens=10,
                                  structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), *constrained]
    expected, _ = _run(spec_checkpoint, params)
    got, llm = _run(spec_checkpoint, params, _config(method, spec_checkpoint))
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    assert got[1][1] == "abc" * 12 and got[3][1] in ("yes", "no")
    _, alone = _run(spec_checkpoint, constrained[:1], _config(method, spec_checkpoint), prompts=PROMPTS[:1])
    assert _spec_metrics(alone)[1] > 0  # the grammar's own repetition was drafted and accepted


def _noisy_copy(checkpoint, path, scale: float):
    """The checkpoint with noise of `scale` on every weight: a draft model that agrees in part."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(checkpoint, path)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    save_file({name: w + scale * torch.randn(w.shape, generator=generator) for name, w in weights.items()},
              path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("engine", [{}, {"num_kvcache_blocks": 24, "kvcache_block_size": 4, "max_model_len": 80}],
                         ids=["plain", "preempted"])
def test_a_draft_model_that_agrees_in_part_gives_the_same_tokens(spec_checkpoint, tmp_path, engine):
    """Drafts accepted in part: the draft's KV of accepted drafts is kept, of rejected ones
    recomputed; a greedy target's tokens stay its own, and both KV caches end empty."""
    draft = _noisy_copy(spec_checkpoint, tmp_path / "draft", 0.02)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected, _ = _run(spec_checkpoint, params, **engine)
    got, llm = _run(spec_checkpoint, params, {"model": str(draft), "num_speculative_tokens": 5}, **engine)
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    drafted, accepted = _spec_metrics(llm)
    assert 0 < accepted < drafted


def test_a_draft_models_padded_vocabulary_never_reaches_the_target(spec_checkpoint, tmp_path):
    """A draft with the target's tokenizer but logits padded past the target's vocabulary (as
    a family's sizes pad theirs differently): a padded id ends its draft, never a verify row."""
    import shutil

    from conftest import TINY_CONFIG
    draft = make_tiny_checkpoint(tmp_path / "padded", seed=3, vocab_size=TINY_CONFIG["vocab_size"] + 64,
                                 eos_token_id=TINY_CONFIG["vocab_size"] - 3)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (spec_checkpoint / name).exists():
            shutil.copy(spec_checkpoint / name, draft / name)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected, _ = _run(spec_checkpoint, params)
    llm = LLM(str(spec_checkpoint), dtype="float32", num_kvcache_blocks=64,
              speculative_config={"model": str(draft), "num_speculative_tokens": 4})
    draft_model = llm.llm_engine.speculation.drafter
    proposals, raw = [], []  # what the engine got, and what the draft's model gave
    propose, greedy_next = draft_model.propose, draft_model.runner.greedy_next
    draft_model.propose = lambda *args: proposals.append(propose(*args)) or proposals[-1]
    draft_model.runner.greedy_next = lambda *args: raw.append(greedy_next(*args)) or raw[-1]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e[0] for e in expected]
    assert max(t for step in raw for t in step) >= TINY_CONFIG["vocab_size"]  # padded ids were drafted
    drafted = [t for step in proposals for d in step for t in d]
    assert drafted and max(drafted) < TINY_CONFIG["vocab_size"]


def test_a_draft_model_lets_go_of_aborted_sequences(spec_checkpoint):
    llm = LLM(str(spec_checkpoint), dtype="float32", num_kvcache_blocks=64,
              speculative_config=_config("draft_model", spec_checkpoint))
    engine = llm.llm_engine
    draft = engine.speculation.drafter
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while len(draft.shadows) < 2:
        engine.step()
    engine.abort_request("0")
    engine.step()
    assert len(draft.shadows) == 1
    while engine.has_unfinished():
        engine.step()
    assert not draft.shadows and draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_a_request_may_draft_fewer_tokens_or_none(spec_checkpoint, method):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected, _ = _run(spec_checkpoint, params)
    config = _config(method, spec_checkpoint)
    for limit in (0, 2):
        limited = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, num_speculative_tokens=limit)
        got, llm = _run(spec_checkpoint, limited, config)
        assert [g[:3] for g in got] == [e[:3] for e in expected]
        per_position = llm.get_metrics()["spec_decode_num_accepted_tokens_per_pos"]
        if limit == 0:
            assert _spec_metrics(llm) == (0, 0)
        else:
            assert per_position[0] > 0 and not any(per_position[limit:])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


def test_many_decoding_sequences_do_not_draft(spec_checkpoint):
    config = {**SPEC_METHODS["ngram"], "disable_by_batch_size": 2}
    _, llm = _run(spec_checkpoint, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), config)
    assert _spec_metrics(llm) == (0, 0)  # four sequences decode together throughout
    _, llm = _run(spec_checkpoint, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), config,
                  prompts=PROMPTS[:2])
    assert _spec_metrics(llm)[0] > 0


def test_metrics_are_exported_under_vllms_names(spec_checkpoint):
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from nanovllm.entrypoints.metrics import ServerMetrics
    _, llm = _run(spec_checkpoint, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                  SPEC_METHODS["ngram"])
    snapshot = llm.get_metrics()
    metrics = ServerMetrics("tiny")
    metrics.watch(SimpleNamespace(metrics=snapshot))
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == snapshot["spec_decode_num_drafts"] > 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == snapshot["spec_decode_num_draft_tokens"]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    assert accepted == snapshot["spec_decode_num_accepted_tokens"] > 0
    per_position = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert snapshot["spec_decode_acceptance_rate"] == accepted / snapshot["spec_decode_num_draft_tokens"]
    assert snapshot["spec_decode_mean_acceptance_length"] == 1 + accepted / snapshot["spec_decode_num_drafts"]


@requires_default_model
@pytest.mark.parametrize("method", SPEC_METHODS)
def test_the_default_models_greedy_text_is_the_same_with_speculation(method):
    """The GGUF kernels compute a verify row as the decode of its token would be (batch
    invariance), so on copy-heavy chats, where most drafts are accepted, the text is the same."""
    import json
    from importlib import resources
    chats = json.loads(resources.files("nanovllm.entrypoints").joinpath("copy_workload.json").read_text())
    conversations = [chat["messages"] for chat in chats]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    texts, accepted = [], []
    for config in (None, _config(method, "smollm2-135m-instruct")):
        llm = LLM(max_model_len=1024, speculative_config=config)
        texts.append([o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)])
        accepted.append(llm.get_metrics().get("spec_decode_num_accepted_tokens"))
    assert texts[0] == texts[1]
    assert accepted[1] > 0


def test_a_speculating_server_streams_the_same_tokens(spec_checkpoint, tmp_path):
    """`serve --speculative-config`: several tokens may arrive in one step; the stream and the
    whole response hold the offline engine's greedy text, and /metrics counts the drafts."""
    import json

    import openai
    import requests

    from test_server import MODEL, Server, metrics
    config = json.dumps(SPEC_METHODS["ngram"])
    server = Server(spec_checkpoint, tmp_path / "server.log", "--speculative-config", config)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        [(_, expected, *_)] = _run(spec_checkpoint, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                   prompts=PROMPTS[:1])[0]
        kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kwargs)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs)
                           if chunk.choices)
        assert whole.choices[0].text == streamed == expected
        m = metrics(server)
        assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0
        # A request that drafts nothing: the same text, no drafts counted.
        none = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "num_speculative_tokens": 0}})
        assert none.choices[0].text == expected
        assert metrics(server)["vllm:spec_decode_num_drafts_total"] == m["vllm:spec_decode_num_drafts_total"]
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
    finally:
        server.stop()
