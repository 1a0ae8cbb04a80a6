"""Engine configuration: the `LLM(...)` keyword arguments, validated and resolved.

Resolving means: find the checkpoint (HF directory, .gguf file or the default-model
alias), read its config, pick device and dtype, and settle the scheduler limits.
Every problem is reported here, before any weight is loaded.
"""

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from nanovllm.pooling_params import DEFAULT_POOLER_CONFIG, RUNNERS, PoolerConfig
from nanovllm.speculative.config import SpeculativeConfig
from nanovllm.startup import phase as startup_phase

if TYPE_CHECKING:
    from nanovllm.loader.checkpoint import Checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The environment variable that sets the CPU threads when num_threads is not given.
NUM_THREADS_ENV = "NANOVLLM_NUM_THREADS"


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, bounded by a cgroup's CPU quota
    (a container's `--cpus`), rounded up. More threads than that wait on each other's turns."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    # vLLM's structured-outputs options: {"disable_additional_properties": bool}; True (the default
    # here, as vLLM's default backend behaves) forbids a JSON schema's undeclared properties.
    structured_outputs_config: dict | None = None
    # vLLM's speculative_config (a dict or a SpeculativeConfig): drafts verified in one step each.
    speculative_config: "SpeculativeConfig | dict | None" = None
    # CPU threads of the kernels and of torch; None: $NANOVLLM_NUM_THREADS, else usable_cpus().
    num_threads: int | None = None
    # None: a GGUF file runs its own block formats where the platform multiplies them; "dense":
    # every weight dequantized at load; "q8_0"/"q4_0": a Hugging Face checkpoint quantized at load.
    quantization: str | None = None
    # "generate", "pooling" (embeddings: LLM.embed, /v1/embeddings), or "auto": pooling for a base
    # model without an LM head (Qwen3Model, ...) or a sentence-transformers directory.
    runner: str = "auto"
    # A pooling model's PoolerConfig (or a dict of its fields); resolved to a PoolerConfig then.
    pooler_config: PoolerConfig | dict | None = None
    # Resolved in __post_init__.
    model_path: str = field(init=False)
    checkpoint: "Checkpoint" = field(init=False)  # the format, decided once
    hf_config: PretrainedConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)
    # speculative_config's draft model (method "draft_model"), configured as an engine of its own.
    draft_config: "EngineConfig | None" = field(init=False, default=None, repr=False)

    def __post_init__(self):
        with startup_phase("checkpoint header and config"):
            self._resolve_model()
        self._resolve_runner()
        self._resolve_device_and_dtype()
        max_pos = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            self.max_model_len = max_pos or 4096
        _check_int("max_model_len", self.max_model_len, 1)
        if max_pos and self.max_model_len > max_pos:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("kvcache_block_size", self.kvcache_block_size, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        self._resolve_num_threads()
        if self.num_kvcache_blocks is not None:
            _check_int("num_kvcache_blocks", self.num_kvcache_blocks, 1)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}; "
                             f"got {self.quantization!r}")
        self.checkpoint.check_quantization(self.quantization)
        self._resolve_structured_outputs_config()
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None and self.runner == "pooling":
            raise ValueError("speculative_config applies to a generating model; a pooling model generates nothing")
        self.draft_config = self._draft_config()

    def _draft_config(self) -> "EngineConfig | None":
        """The draft model's engine config: the target's device, dtype and scheduler limits, one
        rank, and a context no longer than the target's (nor the draft's own positions)."""
        spec = self.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        try:
            draft = EngineConfig(model=spec.model, dtype=self.dtype, device=self.device,
                                 max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                 kvcache_block_size=self.kvcache_block_size, enforce_eager=self.enforce_eager,
                                 seed=self.seed, num_threads=self.num_threads, quantization=spec.quantization,
                                 runner="generate")
        except (ValueError, OSError) as error:
            raise ValueError(f"speculative_config.model {spec.model!r}: {error}") from error
        draft.max_model_len = min(draft.max_model_len, self.max_model_len)
        return draft

    def _resolve_model(self):
        from nanovllm.loader.checkpoint import open_checkpoint

        self.checkpoint = open_checkpoint(self.model)
        self.model_path = self.checkpoint.path
        self.hf_config = self.checkpoint.config()

    def _resolve_runner(self):
        from nanovllm.loader.sentence_transformers import is_sentence_transformers, pooling_defaults
        from nanovllm.models.registry import is_base_model

        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(map(repr, RUNNERS))}, got {self.runner!r}")
        given = PoolerConfig.of(self.pooler_config)
        is_directory = os.path.isdir(self.model_path)
        if self.runner == "auto":
            pools = is_base_model(self.hf_config) or (is_directory and is_sentence_transformers(self.model_path))
            self.runner = "pooling" if pools else "generate"
        if self.runner == "generate":
            if is_base_model(self.hf_config):
                raise ValueError(f"{self.hf_config.architectures} is a base model without an LM head, so it "
                                 "cannot generate; start it with runner='pooling' (embeddings)")
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies to a pooling model only; give runner='pooling' too")
            return
        defaults = pooling_defaults(self.model_path, given.pooling_type is not None) if is_directory else None
        self.pooler_config = given.over(defaults.over(DEFAULT_POOLER_CONFIG) if defaults else DEFAULT_POOLER_CONFIG)

    def _resolve_structured_outputs_config(self):
        given = self.structured_outputs_config or {}
        if not isinstance(given, dict) or set(given) - {"disable_additional_properties"} \
                or not isinstance(given.get("disable_additional_properties", True), bool):
            raise ValueError("structured_outputs_config must be a dict with at most the key "
                             f"'disable_additional_properties' (a bool), got {given!r}")
        self.structured_outputs_config = {"disable_additional_properties": True, **given}

    def _resolve_num_threads(self):
        if self.num_threads is None and os.environ.get(NUM_THREADS_ENV, "").strip():
            value = os.environ[NUM_THREADS_ENV].strip()
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{NUM_THREADS_ENV} must be an integer >= 1, got {value!r}")
            self.num_threads = int(value)
        if self.num_threads is None:
            self.num_threads = usable_cpus()
        _check_int("num_threads", self.num_threads, 1)

    def _resolve_device_and_dtype(self):
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA device is available")
        if self.dtype == "auto":
            from nanovllm.platforms import platform_class
            self.dtype = platform_class(self.device).default_dtype()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, DTYPES))}; got {self.dtype!r}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype='float16' is not supported on CPU; use 'bfloat16' or 'float32'")
        self.torch_dtype = DTYPES[self.dtype]


QUANTIZATIONS = (None, "dense", "q8_0", "q4_0")


def _check_int(name: str, value, minimum: int):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
