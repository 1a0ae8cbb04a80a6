"""What the platform decides when the model is built: an elementwise op's forward and what runs the
decoder layers (chosen once, at construction; an engine's model stays as it was built, nothing
is swapped after load) and the attention backend (which NANOVLLM_ATTENTION_BACKEND overrides)."""

import pytest
import torch

from nanovllm import LLM
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.build_context import built_for
from nanovllm.layers.custom_op import CustomOp
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


class ChoosesCPU:
    """A platform as far as ops ask: the CPU forward, recording which ops asked."""

    def __init__(self):
        self.asked = []

    def choose_forward(self, op):
        self.asked.append(type(op))
        return op.forward_cpu


def test_the_platform_in_force_at_construction_chooses_and_the_choice_stays():
    platform = ChoosesCPU()
    with built_for(platform):
        op, norm = Which(), RMSNorm(8)
    after = Which()  # the choice ends with the block
    assert platform.asked == [Which, RMSNorm] and norm.forward_name == "forward_cpu"
    assert (op(), after()) == ("cpu", "native") and Which().forward_cuda() == "native"  # no kernel: native


def built_state(model: torch.nn.Module) -> dict[str, tuple]:
    """Each module's class, linear method (the object), chosen forward, decoder runner and
    parameter names."""
    return {name: (type(m), getattr(m, "linear_method", None), getattr(m, "forward_name", None),
                   getattr(m, "runner", None), tuple(n for n, _ in m.named_parameters(recurse=False)))
            for name, m in model.named_modules()}


ENGINES = {"eager": dict(dtype="float32", enforce_eager=True), "compiled": dict(dtype="float32"),
           "bf16": dict(dtype="bfloat16"), "q8_0": dict(dtype="bfloat16", quantization="q8_0")}


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_model_stays_as_it_was_built(tiny_checkpoint, monkeypatch, engine):
    """On every path the platform chooses (eager, compiled, fused on the kernels, in blocks): after
    loading, repacking, compiling and warming up, every module is the class it was built as, with
    the linear method, forward and decoder runner it was built with, and no forward of its own."""
    from nanovllm.engine import model_runner

    built = {}

    def recording(hf_config):
        cls = get_model_class(hf_config)

        class Recorded(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                built.update(built_state(self))
        return Recorded

    monkeypatch.setattr(model_runner, "get_model_class", recording)
    llm = LLM(str(tiny_checkpoint("Qwen3ForCausalLM")), num_kvcache_blocks=16, **ENGINES[engine])
    model = llm.llm_engine.executor.model
    assert built and built_state(model) == built
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    platform = llm.llm_engine.executor.platform
    assert ops and all(op.forward_name == platform.choose_forward(op).__name__ for op in ops)
    runner = model.model.layers.runner
    assert (runner is None) == (engine == "eager")


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
