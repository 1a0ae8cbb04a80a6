"""nano-vllm: a fast, readable LLM inference engine shaped like vLLM's core."""

import time as _time

_import_start = _time.perf_counter()

from nanovllm.llm import LLM  # noqa: E402
from nanovllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.startup import record as _record_startup  # noqa: E402

_record_startup("import nanovllm (torch, transformers)", _time.perf_counter() - _import_start)

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
