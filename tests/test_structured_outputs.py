"""Structured outputs and logit_bias: the parameters' validation, the sampler's masking and bias,
and constrained generation on the default model through `LLM.generate` / `LLM.chat`, sampled at
temperature 1 with prefix caching, chunked prefill and a pool small enough to preempt: every
output satisfies its constraint."""

import json
import re
import sys

import jsonschema
import pytest
import torch

from conftest import make_tiny_tokenizer, requires_default_model
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.sampler import Sampler, SamplingBatch
from nanovllm.engine.structured_output import StructuredOutputs, grammar_bitmask, without_undeclared_properties
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.sampling_ops import SamplingOps
from nanovllm.platforms.cpu import KernelSamplingOps

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


# ----- parameters -----

@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one of"),
    ({"json": "{not json"}, "structured_outputs.json must be a JSON schema"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
    ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
])
def test_structured_outputs_params_reject(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_params_key():
    assert StructuredOutputsParams(json='{"type": "object", "b": 1}').key == \
        StructuredOutputsParams(json={"b": 1, "type": "object"}).key
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("bias, message", [
    ({5: 101}, "logit_bias[5] must be a number in [-100, 100]"),
    ({5: float("nan")}, "logit_bias[5] must be a finite number"),
    ({-1: 1.0}, "logit_bias keys must be non-negative token ids"),
    ({"5": 1.0}, "logit_bias keys must be non-negative token ids"),
    ([1, 2], "logit_bias must map token ids"),
])
def test_logit_bias_rejects(bias, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_vocabulary():
    with pytest.raises(ValueError, match=r"logit_bias must map token ids in \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).check_against_vocabulary(100)


def test_without_llguidance_only_constraints_are_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    assert grammar_bitmask([None, None], 100) is None
    outputs = StructuredOutputs(make_tiny_tokenizer(300), 300, {296})
    outputs.prepare()  # logs, does not raise
    with pytest.raises(ValueError, match="pip install llguidance"):
        outputs.compile(StructuredOutputsParams(regex="a+"))


# ----- the sampler -----

def _batch(params, vocab, allowed=None):
    n = len(params)
    return SamplingBatch.build(params, [[0]] * n, [1] * n, [[]] * n, [None] * n, vocab, "cpu", allowed)


def test_sampler_logit_bias_steers_greedy():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 1.0
    params = [SamplingParams(temperature=0, logit_bias={7: 2.0}), SamplingParams(temperature=0, logit_bias={3: -100})]
    out = Sampler()(logits, _batch(params, 10), torch.Generator())
    assert out.token_ids[0] == 7 and out.token_ids[1] != 3


@pytest.mark.parametrize("use_kernel", [True, False])
def test_sampler_bitmask_allows_only_its_tokens(use_kernel):
    if use_kernel and not cpu_kernels.has_simd_kernels():
        pytest.skip("no CPU kernels on this machine")
    sampler = Sampler(KernelSamplingOps() if use_kernel else SamplingOps())
    vocab = 70  # three words, the last one partial
    allowed = {0: [5, 40, 69], 1: [], 2: [33]}  # row 1 unconstrained
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)
    for row, ids in allowed.items():
        if ids:
            bits = torch.zeros(96, dtype=torch.bool)
            bits[ids] = True
            words = (bits.view(3, 32).long() << torch.arange(32)).sum(1)
            bitmask[row] = (words - (words >= 2**31).long() * 2**32).int()
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(3, vocab, generator=generator)
        out = sampler(logits, _batch([SamplingParams(temperature=1.0)] * 3, vocab, bitmask), generator)
        assert out.token_ids[0] in allowed[0] and out.token_ids[2] == 33
    greedy = torch.randn(3, vocab)
    out = sampler(greedy.clone(), _batch([SamplingParams(temperature=0)] * 3, vocab, bitmask), generator)
    assert out.token_ids[1] == int(greedy[1].argmax())
    assert out.token_ids[0] == max(allowed[0], key=lambda t: greedy[0, t])


# ----- constrained generation on the default model -----

@pytest.fixture(scope="module")
def llm():
    # 20 blocks of 16 tokens for 12 streams of ~40-token prompts and up to 160 new tokens:
    # preemption is certain; 32-token steps chunk every prompt.
    return LLM(max_model_len=256, num_kvcache_blocks=20, max_num_batched_tokens=32, max_num_seqs=8,
               enforce_eager=True)


def _is_date(text: str) -> bool:
    return re.fullmatch(DATE, text) is not None


@requires_default_model
def test_constrained_generation_stays_valid_under_preemption(llm):
    system = {"role": "system", "content": "You are a helpful assistant that answers briefly and precisely."}
    cases = [
        ("Describe a fictional person as JSON.", StructuredOutputsParams(json=PERSON),
         lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
        ("When did the Apollo 11 mission land on the moon? Give the date.", StructuredOutputsParams(regex=DATE),
         _is_date),
        ("Is the sea salty? Answer yes or no.", StructuredOutputsParams(choice=["yes", "no", "maybe"]),
         lambda text: text in ("yes", "no", "maybe")),
        ("Give a JSON object about a cat.", StructuredOutputsParams(json_object=True),
         lambda text: isinstance(json.loads(text), dict)),
        ("What is 6 times 7?", StructuredOutputsParams(grammar='start: "The answer is " NUMBER "."\n'
                                                                'NUMBER: /[0-9]{1,4}/'),
         lambda text: re.fullmatch(r"The answer is [0-9]{1,4}\.", text) is not None),
    ]
    conversations = [[system, {"role": "user", "content": question}] for question, _, _ in cases]
    params = [SamplingParams(n=3 if i < 2 else 1, temperature=1.0, seed=i, max_tokens=160, structured_outputs=c)
              for i, (_, c, _) in enumerate(cases)]
    # The same conversation twice: the second finds the first's prompt blocks in the prefix cache.
    outputs = llm.chat(conversations + conversations[:1], params + params[:1], use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] > 0
    assert metrics["num_free_blocks"] == metrics["num_kvcache_blocks"]
    for (_, _, valid), output in zip(cases + cases[:1], outputs):
        for completion in output.outputs:
            # A JSON object with a 160-token budget may run out; all else must complete.
            if completion.finish_reason == "length":
                continue
            assert completion.finish_reason == "stop", completion
            assert valid(completion.text), completion.text
    json_done = [c for c in outputs[0].outputs + outputs[-1].outputs if c.finish_reason == "stop"]
    assert json_done, "no JSON document completed within 160 tokens"


@requires_default_model
def test_choice_greedy_and_eos_only_when_complete(llm):
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=20,
                                      structured_outputs=StructuredOutputsParams(choice=[" Paris", " Rome"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == " Paris" and out.finish_reason == "stop"
    # A regex that may go on: it ends only where the grammar accepts (EOS allowed there), or at
    # the length limit, never mid-pattern.
    outs = llm.generate(["Numbers:"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=12,
                                                          structured_outputs=StructuredOutputsParams(regex=r"[0-9]+(,[0-9]+)*"))
                                           for s in range(4)], use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert re.fullmatch(r"[0-9]+(,[0-9]+)*,?", c.text), c.text
        if c.finish_reason == "stop":
            assert re.fullmatch(r"[0-9]+(,[0-9]+)*", c.text), c.text


@requires_default_model
@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(regex="(abc"), "structured_outputs.regex is not valid"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar is not valid"),
    (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json is not valid"),
])
def test_rejected_constraint_leaves_engine_serving(llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    metrics = llm.get_metrics()
    assert metrics["num_free_blocks"] == metrics["num_kvcache_blocks"] and metrics["num_waiting"] == 0


def test_undeclared_properties_are_forbidden_where_the_schema_is_silent():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
              "$defs": {"Item": {"properties": {"name": {"type": "string"}}},
                        "Open": {"properties": {"y": {}}, "additionalProperties": True},
                        "Either": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]}}}
    closed = without_undeclared_properties(schema)
    assert closed["additionalProperties"] is False
    # A property named "properties" is a property, not the keyword: its schema is closed, the map is not.
    assert "additionalProperties" not in closed["properties"]
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["$defs"]["Item"]["additionalProperties"] is False
    assert closed["$defs"]["Open"]["additionalProperties"] is True  # said by the schema: kept
    either = closed["$defs"]["Either"]["anyOf"]
    assert either[0]["additionalProperties"] is False and either[1] == {"type": "string"}
    assert "additionalProperties" not in schema  # a copy
    jsonschema.validate({"properties": {"x": 1}, "items": [{"name": "a"}]}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"properties": {"x": 1}, "items": [{"name": "a", "junk": 1}]}, closed)
