"""The CPU kernels' variants (NANOVLLM_CPU_ISA): the kernel tests run again, in a process of
their own, under every variant this CPU executes besides the one this process built, and a
variant that cannot run here, or does not exist, is refused with a clear error."""

import os
import subprocess
import sys

import pytest

from nanovllm.kernels import cpu as cpu_kernels

KERNEL_TESTS = os.path.join(os.path.dirname(__file__), "test_cpu_kernels.py")


def run_with_isa(variant: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{cpu_kernels.ISA_ENV: variant})
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize("variant", list(cpu_kernels.ISAS))
def test_kernel_tests_pass_under_each_variant(variant):
    if variant not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot execute {variant}")
    if variant == cpu_kernels.isa():
        pytest.skip(f"{variant} is this process's own build, which test_cpu_kernels.py tests")
    result = run_with_isa(variant, "-m", "pytest", "-q", "-p", "no:cacheprovider", KERNEL_TESTS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]


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
