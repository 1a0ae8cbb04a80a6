"""No request can poison the offline engine: hostile sampling values are refused at admission,
a step that fails ends only its own requests, and n > 1 requests are admitted with everything
else. After every test the engine is idle (no block held, nothing running or waiting) and a
greedy reference answer is unchanged."""

import math

import pytest
import torch

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams

VOCAB = 320  # conftest's tiny vocabulary
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REFERENCE_PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")
    return LLM(str(path), dtype="float32", num_kvcache_blocks=512, kvcache_block_size=16)


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return llm.generate([REFERENCE_PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(autouse=True)
def engine_stays_sound(llm, reference):
    yield
    engine = llm.llm_engine
    assert not engine.has_unfinished() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate([REFERENCE_PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=10**6), "logprobs"),
    (dict(prompt_logprobs=10**6), "prompt_logprobs"),
    (dict(stop_token_ids=[10**6], min_tokens=1), "stop_token_ids"),
    (dict(stop_token_ids=[VOCAB], min_tokens=1), "stop_token_ids"),  # just past the last id
    (dict(stop_token_ids=[2**64]), "stop_token_ids"),
    (dict(top_k=2**63, temperature=1.0), "top_k"),
    (dict(top_k=VOCAB + 1, temperature=1.0), "top_k"),
    (dict(temperature=math.inf, min_tokens=2), "temperature"),
    (dict(temperature=1e39, min_tokens=2), "temperature"),  # inf once stored as float32
    (dict(temperature=math.nan), "temperature"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(include_stop_str_in_output=3), "include_stop_str_in_output"),
    (dict(stop=5), "stop"),
    (dict(seed=2**64), "seed"),
])
def test_poisoning_params_are_refused_before_anything_is_queued(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate([REFERENCE_PROMPT, [1, 2, 3]], SamplingParams(max_tokens=4, **kwargs), use_tqdm=False)


def test_vocabulary_limits_are_inclusive(llm):
    params = SamplingParams(max_tokens=4, top_k=VOCAB, temperature=1.0, stop_token_ids=[VOCAB - 1], min_tokens=1)
    [out] = llm.generate([REFERENCE_PROMPT], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("prompt", ["abc\ud800", {"prompt": "\udfff", "prompt_token_ids": [1, 2]}])
def test_lone_surrogates_are_refused_as_the_prompt(llm, prompt):
    with pytest.raises(ValueError, match="prompt must be valid Unicode text; it holds a lone surrogate"):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_lone_surrogates_are_refused_in_chat_messages(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=32)
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be valid Unicode"):
        llm.chat([{"role": "system", "content": "hi"}, {"role": "user", "content": "abc\ud800"}], GREEDY,
                 use_tqdm=False)


def test_a_failing_step_ends_only_its_requests(llm, monkeypatch):
    """NaN logits for one step: the sampler refuses to return an id outside the vocabulary, that
    step's requests finish with "error" and free their blocks, and the engine serves the next
    step (where the poisoned id would otherwise have been embedded)."""
    engine = llm.llm_engine
    model = engine.executor.model
    compute_logits = model.compute_logits
    calls = []

    def nan_once(hidden):
        logits = compute_logits(hidden)
        calls.append(len(logits))
        return torch.full_like(logits, math.nan) if len(calls) == 1 else logits

    monkeypatch.setattr(model, "compute_logits", nan_once)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], [sampled, GREEDY], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all(o.finished and o.outputs[0].token_ids == [] for o in outs)
    # The next request runs normally.
    [after] = llm.generate([[1, 2, 3]], sampled, use_tqdm=False)
    assert after.outputs[0].finish_reason == "length" and len(after.outputs[0].token_ids) == 8


def test_a_step_error_fails_the_whole_request_and_spares_others(llm, monkeypatch):
    """A request running while another's step fails is not in that step, so it goes on."""
    engine = llm.llm_engine
    engine.add_request("long", [9, 9, 9], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()  # "long" is decoding
    sampler = engine.executor.sampler
    forward = sampler.forward

    def fail_with_newcomer(logits, batch, generator):
        if len(logits) > 1:
            raise RuntimeError("a fault of this step's inputs")
        return forward(logits, batch, generator)

    monkeypatch.setattr(sampler, "forward", fail_with_newcomer)
    engine.add_request("doomed", [1, 2], SamplingParams(n=3, temperature=1.0, max_tokens=5))
    failed = engine.step()  # "long" decodes in this step too: both fail
    assert {o.request_id for o in failed} == {"long", "doomed"}
    assert all(c.finish_reason == "error" for o in failed for c in o.outputs)
    assert not engine.has_unfinished()


def test_a_device_error_stops_the_engine(llm, monkeypatch):
    engine = llm.llm_engine

    def device_fault(batch):
        raise torch.AcceleratorError("an illegal memory access")

    monkeypatch.setattr(engine.executor, "execute", device_fault)
    engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(torch.AcceleratorError):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("r")


def test_n_completions_are_admitted_in_one_step_with_everything_else(llm):
    """16 requests of n=16 and max_tokens=1 finish in one step (they took 17 when a request's
    later streams waited a step for the first one's prompt and held up the queue behind them).
    The later streams attend to prompt blocks their first stream writes in that same step:
    greedy, all 16 streams of a request pick the token a lone request picks."""
    engine = llm.llm_engine
    prompts = [[10 + i] * 20 for i in range(16)]  # a full block and a partial one each
    for i, p in enumerate(prompts):
        engine.add_request(f"n16-{i}", p, SamplingParams(n=16, temperature=0, max_tokens=1))
    outputs = engine.step()
    assert not engine.has_unfinished()
    assert sorted(o.request_id for o in outputs) == sorted(f"n16-{i}" for i in range(16))
    for o in outputs:
        [alone] = llm.generate([o.prompt_token_ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        assert [c.token_ids for c in o.outputs] == [alone.outputs[0].token_ids] * 16
