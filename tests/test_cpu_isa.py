"""The CPU kernels' variants (NANOVLLM_CPU_ISA): the kernel tests (dense, quantized, experts) run again, in a process of
their own, under every variant this CPU executes besides the one this process built; the engine
runs with the kernels off (`none`, what an ARM or older x86 CPU gets) and gives the greedy
tokens it gives with them; and a variant that cannot run here, or does not exist, is refused
with a clear error."""

import json
import os
import subprocess
import sys

import pytest

from conftest import make_tiny_checkpoint
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu as cpu_kernels

KERNEL_TESTS = [os.path.join(os.path.dirname(__file__), name) for name in ("test_cpu_kernels.py", "test_cpu_quantized.py",
                                                                                  "test_cpu_moe.py")]


def run_with_isa(variant: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{cpu_kernels.ISA_ENV: variant})
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize("variant", list(cpu_kernels.ISAS))
def test_kernel_tests_pass_under_each_variant(variant):
    if variant not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot execute {variant}")
    if variant == cpu_kernels.isa():
        pytest.skip(f"{variant} is this process's own build, which test_cpu_kernels.py tests")
    result = run_with_isa(variant, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]


GREEDY_SCRIPT = """
import json, sys
from nanovllm import LLM, SamplingParams
from nanovllm.kernels import cpu
llm = LLM(sys.argv[1], num_kvcache_blocks=32)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"isa": cpu.isa(), "dtype": llm.llm_engine.config.dtype, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def test_the_engine_runs_with_the_kernels_off(tmp_path):
    """`none`: dtype auto is fp32 and the layers are plain PyTorch (compiled); fp32 greedy tokens
    equal this process's fp32 engine's, whatever its variant."""
    path = str(make_tiny_checkpoint(tmp_path, "LlamaForCausalLM"))
    prompts = [[5, 17, 42, 7], list(range(30, 70))]
    expected = LLM(path, dtype="float32", num_kvcache_blocks=32).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    result = run_with_isa("none", "-c", GREEDY_SCRIPT, path, json.dumps(prompts))
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["isa"] == "none" and out["dtype"] == "float32"
    assert out["tokens"] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("variant, message", [("avx9000", "is not a kernel variant"), ("avx512", "cannot execute")])
def test_a_variant_this_cpu_cannot_run_is_refused(variant, message):
    if variant in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU executes {variant}")
    result = run_with_isa(variant, "-c", "from nanovllm.kernels import cpu; cpu.available()")
    assert result.returncode != 0 and message in result.stderr and cpu_kernels.ISA_ENV in result.stderr


def test_the_build_reports_its_variant():
    """Unforced, the best variant the CPU runs is built; forced, the one asked for."""
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels could not be built here")
    import torch
    assert torch.ops.nanovllm_cpu.isa() == cpu_kernels.isa()
    forced = os.environ.get(cpu_kernels.ISA_ENV)
    assert cpu_kernels.isa() == (forced or cpu_kernels.runnable_isas()[0])


def test_an_amx_build_multiplies_on_tiles():
    """The amx variant's many-row path falls back to AVX-512 where the kernel refuses the tiles,
    with the same results: only this tells the two apart."""
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels could not be built here")
    import torch
    assert torch.ops.nanovllm_cpu.amx_tiles_granted() == (cpu_kernels.isa() == "amx")


def test_every_kernel_source_is_in_exactly_one_translation_unit():
    """The build compiles cpu/units/*.cpp, which include the sources: a file in none would be left
    out of the extension, a file in two defined twice."""
    included = []
    for unit in cpu_kernels._UNITS:
        with open(unit) as f:
            included += [os.path.normpath(os.path.join(os.path.dirname(unit), line.split('"')[1]))
                         for line in f if line.startswith("#include")]
    assert sorted(included) == sorted(os.path.normpath(path) for path in cpu_kernels._SOURCES)


def test_each_python_environment_keeps_its_own_build(monkeypatch):
    """The build remembers the environment's torch headers: two environments sharing one build
    name would rebuild it at every switch between them, so the name differs between them."""
    name = cpu_kernels.build_name("none")
    assert cpu_kernels.build_name("none") == name
    monkeypatch.setattr(sys, "prefix", "/another/environment")
    assert cpu_kernels.build_name("none") != name


def test_a_build_killed_midway_does_not_stall_the_next_load():
    """torch's build leaves its `lock` file behind when killed, and a later load would wait on it
    forever: the next process finds it stale and loads."""
    if not cpu_kernels.available():
        pytest.skip("no compiler here: the kernels are not built")
    lock = os.path.join(cpu_kernels.build_directory(cpu_kernels.build_name(cpu_kernels.isa())), "lock")
    open(lock, "w").close()
    result = subprocess.run([sys.executable, "-c", "from nanovllm.kernels import cpu; print(cpu.available())"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.split() == ["True"], result.stderr[-4000:]
    assert not os.path.exists(lock)
