"""Adding a dense family takes its module and a registry line, nothing else: a toy family defined
here, a DecoderForCausalLM with a description of its own (an embedding scale, softcapped attention
and logits, a window on every other layer, tanh-GELU), registered by name, loads a checkpoint of
its architecture, and runs on the fused CPU path in bf16 (bit for bit eager's) and compiled in
fp32 (eager's tokens)."""

import json

import pytest

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.models import registry
from nanovllm.models.decoder import DecoderDescription, DecoderForCausalLM, FULL_ATTENTION, SLIDING_ATTENTION


class ToyForCausalLM(DecoderForCausalLM):
    @staticmethod
    def describe(config) -> DecoderDescription:
        return DecoderDescription(activation="gelu_pytorch_tanh", embedding_scale=2.0, attn_logit_softcap=4.0,
                                  final_logit_softcap=8.0, sliding_window=9,
                                  layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * (config.num_hidden_layers // 2))


@pytest.fixture
def toy_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._MODELS, "ToyForCausalLM", ToyForCausalLM)
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")  # the toy's weights are named as Llama's
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["ToyForCausalLM"]}))
    return str(path)


def greedy(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate([list(range(3, 40)), [5, 6, 7]], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_family_defined_outside_the_package_runs_on_the_platforms_paths(toy_checkpoint, dtype):
    settings = dict(dtype=dtype, num_kvcache_blocks=16, max_num_batched_tokens=24)
    fast, eager = LLM(toy_checkpoint, **settings), LLM(toy_checkpoint, enforce_eager=True, **settings)
    model = fast.llm_engine.executor.model
    assert type(model) is ToyForCausalLM
    runner = type(model.model.layers.runner).__name__
    on_kernels = dtype == "bfloat16" and cpu_kernels.has_simd_kernels()
    assert runner == ("FusedDecoderLayers" if on_kernels else "CompiledDecoderLayers")
    (fast_out, eager_out) = greedy(fast), greedy(eager)
    if on_kernels:  # the fused call repeats eager's kernels bit for bit
        assert fast_out == eager_out
    else:  # compiled fp32 sums in its own order: the same tokens, log-probabilities to rounding
        assert [t for t, _ in fast_out] == [t for t, _ in eager_out]
        assert [lp for _, lp in fast_out] == pytest.approx([lp for _, lp in eager_out], rel=1e-5)
