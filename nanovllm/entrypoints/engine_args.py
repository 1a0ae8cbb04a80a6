"""The engine's command-line flags, named like vLLM's, and their mapping to `LLM(...)` keyword
arguments. Every command that loads a model (generate, chat, serve, bench) uses these two
functions, so a flag means the same thing everywhere and its default is `EngineConfig`'s.
"""

import argparse
import dataclasses
import json
import logging
from typing import Any

from nanovllm.config import DTYPES, QUANTIZATIONS, EngineConfig
from nanovllm.loader.default_model import DEFAULT_MODEL_ALIAS
from nanovllm.pooling_params import POOLING_TYPES, RUNNERS

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.init}

# (flags, LLM keyword, argparse options); the keyword is also the parsed attribute's name.
_ENGINE_FLAGS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (("--model",), "model", dict(default=DEFAULT_MODEL_ALIAS, metavar="MODEL",
                                 help="Hugging Face model directory, .gguf file, or the alias "
                                      f"{DEFAULT_MODEL_ALIAS!r}")),
    (("--dtype",), "dtype", dict(choices=["auto", *DTYPES],
                                 help="weight and activation dtype; auto: bfloat16 on GPUs and on CPUs the "
                                      "kernels run on (AVX512-BF16 or AVX2), else float32")),
    (("--device",), "device", dict(choices=["auto", "cpu", "cuda"], help="auto: cuda when available")),
    (("--max-model-len",), "max_model_len", dict(type=int, metavar="N",
                                                 help="longest prompt + output, in tokens (default: the model's)")),
    (("--max-num-seqs",), "max_num_seqs", dict(type=int, metavar="N", help="most sequences in one step")),
    (("--max-num-batched-tokens",), "max_num_batched_tokens",
     dict(type=int, metavar="N", help="per-step token budget shared by decodes and prompt chunks")),
    (("--block-size",), "kvcache_block_size", dict(type=int, metavar="N", help="tokens per KV-cache block")),
    (("--num-kvcache-blocks",), "num_kvcache_blocks", dict(type=int, metavar="N",
                                                           help="KV-cache size in blocks (wins over memory)")),
    (("--kv-cache-memory-gb",), "kv_cache_memory_gb", dict(type=float, metavar="GB", help="KV-cache size in GiB")),
    (("--gpu-memory-utilization",), "gpu_memory_utilization",
     dict(type=float, metavar="F", help="share of GPU memory the engine may fill")),
    (("--enable-prefix-caching",), "enable_prefix_caching",
     dict(action=argparse.BooleanOptionalAction, help="reuse the KV cache of shared prompt prefixes (default: on)")),
    (("--enforce-eager",), "enforce_eager", dict(action="store_true", help="no torch.compile / CUDA graphs")),
    (("--tensor-parallel-size", "-tp"), "tensor_parallel_size", dict(type=int, metavar="N",
                                                                     help="number of tensor-parallel ranks")),
    (("--seed",), "seed", dict(type=int, help="seed of the engine's random stream")),
    (("--structured-outputs-config",), "structured_outputs_config",
     dict(type=lambda text: _json_object("--structured-outputs-config", text), metavar="JSON",
          help='structured-outputs options, as vLLM\'s: \'{"disable_additional_properties": false}\' lets a JSON '
               "schema's output hold properties the schema does not declare (default: forbidden, unless the "
               "schema's additionalProperties allows them)")),
    (("--speculative-config",), "speculative_config",
     dict(type=lambda text: _json_object("--speculative-config", text), metavar="JSON",
          help='speculative decoding, as vLLM names it: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
               "(prompt_lookup_min/max), '{\"method\": \"suffix\"}' (suffix_decoding_*) or a draft model with "
               "the same tokenizer, '{\"model\": \"small.gguf\", \"num_speculative_tokens\": 4}'; "
               "disable_by_batch_size: no drafts when more sequences decode (default: off)")),
    (("--threads",), "num_threads", dict(type=int, metavar="N",
                                         help="CPU threads (default: $NANOVLLM_NUM_THREADS, else the CPUs this "
                                              "process may use: its affinity and cgroup quota)")),
    (("--quantization", "-q"), "quantization",
     dict(choices=[q for q in QUANTIZATIONS if q], help="unset: a GGUF file runs its own quantized types where the "
                                                       "platform multiplies them (CPUs), else dequantized at load; "
                                                       "dense: dequantize every weight at load; q8_0/q4_0: quantize "
                                                       "a Hugging Face checkpoint at load")),
    (("--runner",), "runner", dict(choices=RUNNERS, help="pooling: the model embeds (LLM.embed, /v1/embeddings) "
                                                         "and cannot generate; auto: pooling for a base model "
                                                         "without an LM head or a sentence-transformers "
                                                         "directory, else generate")),
    (("--pooler-config",), "pooler_config",
     dict(type=lambda text: _json_object("--pooler-config", text), metavar="JSON",
          help='a pooling model\'s pooling, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' (pooling_type '
               f"{', '.join(POOLING_TYPES)}; default: the checkpoint's sentence-transformers files, else LAST "
               "and normalized)")),
]


def _json_object(flag: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {text!r}")
    return value


LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (defaults are EngineConfig's) to `parser` as their own help group,
    and --log-level."""
    group = parser.add_argument_group("engine options")
    for flags, kwarg, options in _ENGINE_FLAGS:
        options = {"default": _DEFAULTS[kwarg], **options}
        if options["default"] is not None and "action" not in options:
            options["help"] += " (default: %(default)s)"
        group.add_argument(*flags, dest=kwarg, **options)
    group.add_argument("--log-level", choices=LOG_LEVELS,
                       help="what nano-vllm logs to stderr (default: warning; serve: info, uvicorn's too); "
                            "debug adds how long each phase of start-up took")


def configure_logging(level: str | None) -> None:
    """nano-vllm's loggers (not other libraries') print to stderr from `level` up."""
    logger = logging.getLogger("nanovllm")
    logger.setLevel((level or "warning").upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(**kwargs)` keyword arguments that the parsed engine flags stand for."""
    return {kwarg: getattr(args, kwarg) for _, kwarg, _ in _ENGINE_FLAGS}
