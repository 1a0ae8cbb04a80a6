"""What the platform decides when the model is built: an elementwise op's forward (chosen once, at
construction; an engine's model keeps the classes it was built as, nothing is swapped after load)
and the attention backend (which NANOVLLM_ATTENTION_BACKEND overrides)."""

import pytest
import torch

from nanovllm import LLM
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.custom_op import CustomOp, built_for
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.models.registry import get_model_class


def test_an_op_built_outside_a_platform_runs_native():
    act = SiluAndMul()
    x = torch.randn(3, 8)
    assert act.forward_name == "forward_native"
    torch.testing.assert_close(act(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])


class Which(CustomOp):
    def forward_native(self):
        return "native"

    def forward_cpu(self):
        return "cpu"


def test_the_platform_in_force_at_construction_chooses_and_the_choice_stays():
    calls = []

    def choose(op):
        calls.append(type(op))
        return op.forward_cpu

    with built_for(choose):
        op, norm = Which(), RMSNorm(8)
    after = Which()  # the choice ends with the block
    assert calls == [Which, RMSNorm] and norm.forward_name == "forward_cpu"
    assert (op(), after()) == ("cpu", "native") and Which().forward_cuda() == "native"  # no kernel: native


def test_an_engine_model_keeps_the_classes_it_was_built_as(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), dtype="float32", num_kvcache_blocks=16, enforce_eager=True)
    runner = llm.llm_engine.executor
    built = {name: type(m) for name, m in
             get_model_class(runner.config.hf_config)(runner.config.hf_config, runner.tp_group).named_modules()}
    model = runner.model
    assert {name: type(m) for name, m in model.named_modules()} == built
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert ops and all(op.forward_name == runner.platform.choose_forward(op).__name__ for op in ops)


def test_the_platform_chooses_the_attention_backend_and_the_environment_overrides_it(tiny_checkpoint, monkeypatch):
    from nanovllm.attention.cpu import CPUBackend
    from nanovllm.attention.selector import BACKEND_ENV
    from nanovllm.attention.torch_native import TorchNativeBackend
    from nanovllm.kernels import cpu as cpu_kernels
    path = str(tiny_checkpoint("LlamaForCausalLM"))
    runner = LLM(path, dtype="float32", num_kvcache_blocks=16, enforce_eager=True).llm_engine.executor
    assert type(runner.backend) is (CPUBackend if cpu_kernels.available() else TorchNativeBackend)
    assert runner.platform.attention_backend(63, 16) == "torch_native"  # an odd head size
    monkeypatch.setenv(BACKEND_ENV, "torch_native")
    forced = LLM(path, dtype="float32", num_kvcache_blocks=16, enforce_eager=True).llm_engine.executor
    assert type(forced.backend) is TorchNativeBackend
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="NANOVLLM_ATTENTION_BACKEND='fast'; expected one of cpu, torch_native"):
        LLM(path, dtype="float32", num_kvcache_blocks=16, enforce_eager=True)
