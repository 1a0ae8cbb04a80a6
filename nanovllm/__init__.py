"""nano-vllm: a fast, readable LLM inference engine shaped like vLLM's core."""

import os as _os
import time as _time

_import_start = _time.perf_counter()

# torch's own ops (oneDNN's GEMMs among them) run on OpenMP, whose idle threads spin for
# milliseconds after each parallel region; the CPU kernels run on a pool of their own
# (kernels/cpu/thread_pool.h), and an OpenMP thread spinning beside that pool's takes its core.
# Passive OpenMP threads sleep at once instead. libgomp reads this once, when torch loads it, so
# it is set before torch is imported; a process that imported torch first keeps its own policy.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nanovllm.llm import LLM  # noqa: E402
from nanovllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.startup import record as _record_startup  # noqa: E402

_record_startup("import nanovllm (torch, transformers)", _time.perf_counter() - _import_start)

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
