"""nano-vllm: a fast, readable LLM inference engine shaped like vLLM's core."""

import importlib as _importlib
import os as _os
import sys as _sys
import time as _time

# torch's own ops (oneDNN's GEMMs among them) run on OpenMP, whose idle threads spin for
# milliseconds after each parallel region; the CPU kernels run on a pool of their own
# (kernels/cpu/thread_pool.h), and an OpenMP thread spinning beside that pool's takes its core.
# Passive OpenMP threads sleep at once instead. libgomp reads this once, when torch loads it, so
# it is set before torch is imported; a process that imported torch first keeps its own policy.
_USER_OMP_WAIT_POLICY = _os.environ.get("OMP_WAIT_POLICY")
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The exports load on first use (PEP 562), and torch with them: a process that imports only a
# module of ours that needs no torch (the bench's comparison engines) never loads it.
_EXPORTS = {
    "LLM": "nanovllm.llm",
    "SamplingParams": "nanovllm.sampling_params",
    "StructuredOutputsParams": "nanovllm.sampling_params",
    "RequestOutput": "nanovllm.outputs",
    "CompletionOutput": "nanovllm.outputs",
    "PoolingParams": "nanovllm.pooling_params",
    "PoolerConfig": "nanovllm.pooling_params",
    "EmbeddingRequestOutput": "nanovllm.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    start = _time.perf_counter()
    torch_loaded = "torch" in _sys.modules
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    if not torch_loaded and "torch" in _sys.modules:
        from nanovllm.startup import record
        record("import nanovllm (torch, transformers)", _time.perf_counter() - start)
    globals()[name] = value
    return value


def user_environment() -> dict[str, str]:
    """The environment as the user gave it, without the OpenMP policy set above: for the
    processes that run other engines (the bench's comparisons) as their own users run them."""
    env = dict(_os.environ)
    if _USER_OMP_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = _USER_OMP_WAIT_POLICY
    return env
