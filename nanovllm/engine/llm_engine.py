"""The engine: validates and tokenizes requests, steps scheduler and model runner, and turns
sampled tokens into outputs (logprobs, incremental text, stop strings).

`add_request` / `step` / `abort_request` is the streaming interface the CLI and the server
use; `step` returns a RequestOutput for every request that advanced, with cumulative text.
"""

import json
import logging
import os
from itertools import count

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import EngineConfig
from nanovllm.distributed.executor import make_executor
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sequence import Request, Sequence
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from nanovllm.sampling_params import SamplingParams, check_text

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = collect_eos_token_ids(config, self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        self.model_runner = make_executor(config)
        self.model_runner.eos_token_ids = self.eos_token_ids
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._request_ids = count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_tokens_computed = 0  # prompt (and recomputed) tokens run through the model
        self.decode_tokens_computed = 0

    # ----- requests -----

    def make_request(self, prompt, sampling_params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate and tokenize one prompt; raises ValueError before anything is queued."""
        if request_id is None:
            request_id = str(next(self._request_ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params.check_against_vocabulary(self.vocab_size)
        text, prompt = _split_prompt(prompt)
        if text is not None:
            check_text("prompt", text)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); "
                                 f"got {bad[:5]}")
        else:
            raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        max_len = self.config.max_model_len
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - len(token_ids)
            if max_tokens < 1:
                raise ValueError(f"prompt ({len(token_ids)} tokens) leaves no room to generate within "
                                 f"max_model_len={max_len}")
        elif len(token_ids) + max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) "
                             f"= {len(token_ids) + max_tokens} exceeds max_model_len={max_len}")
        return Request(request_id, text, token_ids, sampling_params, max_tokens)

    def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams) -> Request:
        request = self.make_request(prompt, sampling_params, request_id)
        self.enqueue(request)
        return request

    def enqueue(self, request: Request):
        """Queue a request made by make_request."""
        self.requests[request.request_id] = request
        self.prompt_tokens += len(request.prompt_token_ids)
        for seq in request.seqs:
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling_params)
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
        output = self._output(request)
        self._forget(request)
        return output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- stepping -----

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the outputs of the requests that advanced."""
        batch = self.scheduler.schedule()
        try:
            out = self.model_runner.execute(batch)
        except Exception as error:
            if not self.model_runner.survives(error):
                raise
            return self._fail_step(batch, error)
        num_decode = sum(1 for seq, n in zip(batch.seqs, batch.num_new_tokens)
                         if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.decode_tokens_computed += num_decode
        self.prefill_tokens_computed += batch.num_tokens - num_decode
        self._record_prompt_logprobs(out)
        advanced = self.scheduler.postprocess(batch, out.token_ids)
        self.generation_tokens += len(advanced)
        for seq, logprobs in zip(advanced, out.logprobs):
            self._process_token(seq, logprobs)
        requests = {seq.request_id: self.requests[seq.request_id] for seq in advanced}
        outputs = [self._output(request) for request in requests.values()]
        for request in requests.values():
            if request.finished:
                self._forget(request)
        return outputs

    def _fail_step(self, batch: ScheduledBatch, error: Exception) -> list[RequestOutput]:
        """A step raised, leaving the engine sound: its requests end with finish_reason "error"
        and free their blocks (no hash of this step's blocks was published), and the engine
        goes on with the others."""
        requests = {seq.request_id: self.requests[seq.request_id] for seq in batch.seqs}
        logger.error("a step failed; ending its requests %s with an error", sorted(requests), exc_info=error)
        for request in requests.values():
            for seq in request.seqs:
                self.scheduler.finish(seq, "error")
        outputs = [self._output(request) for request in requests.values()]
        for request in requests.values():
            self._forget(request)
        return outputs

    def _process_token(self, seq: Sequence, logprobs):
        """Record the new token's logprobs and text; finish seq on a stop string."""
        token = seq.token_ids[-1]
        if logprobs is not None:
            seq.logprobs.append(self._position_logprobs(token, logprobs))
            seq.cumulative_logprob += logprobs[0]
        params = seq.sampling_params
        # A stop token's own text is left out, as vLLM does, unless asked for.
        if seq.is_finished and seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            return
        detokenizer = self._detokenizers[seq.seq_id]
        stop = detokenizer.add_token(token, check_stop=seq.num_completion_tokens >= params.min_tokens)
        if stop is not None:
            self.scheduler.finish(seq, "stop", stop)

    def _record_prompt_logprobs(self, out: SamplerOutput):
        for seq, first, entries in out.prompt_logprobs:
            # After a preemption the prompt is recomputed: keep only positions not yet recorded.
            skip = len(seq.prompt_logprobs) - first
            for position, entry in enumerate(entries[skip:], start=first + skip):
                seq.prompt_logprobs.append(self._position_logprobs(seq.token_ids[position], entry))

    def _position_logprobs(self, token: int, entry) -> PositionLogprobs:
        chosen_logprob, rank, top = entry
        result = {tid: Logprob(lp, r, self.tokenizer.decode([tid])) for r, (tid, lp) in enumerate(top, start=1)}
        if token not in result:
            result[token] = Logprob(chosen_logprob, rank, self.tokenizer.decode([token]))
        return result

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            text = self._detokenizers[seq.seq_id].output_text(seq.is_finished)
            wants_logprobs = request.sampling_params.logprobs is not None
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.completion_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if wants_logprobs else None,
                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            ))
        first = request.seqs[0]
        prompt_logprobs = list(first.prompt_logprobs) if request.sampling_params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished=request.finished, prompt_logprobs=prompt_logprobs)

    def _forget(self, request: Request):
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._detokenizers.pop(seq.seq_id, None)

    def get_metrics(self) -> dict:
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_kvcache_blocks": self.block_manager.num_blocks,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


def _split_prompt(prompt) -> tuple[str | None, object]:
    """(its text, if any; what to tokenize or the token ids) of a prompt in any accepted form."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"a dict prompt's 'prompt' must be a str, got {type(text).__name__}")
            return text, prompt["prompt_token_ids"]
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key, "
                             f"got keys {sorted(prompt)}")
    return (prompt if isinstance(prompt, str) else None), prompt


# Files that hold a vocabulary; without one, transformers builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    if config.is_gguf:
        from nanovllm.loader.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(config.model_path)
    path = config.model_path
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"model directory {path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         "copy the tokenizer files of the model into it")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, TypeError, KeyError) as e:  # a corrupt tokenizer.json, a bad tokenizer_config
        files = sorted(name for name in os.listdir(path) if name.startswith(("tokenizer", "vocab", "special")))
        message = " ".join(str(e).split())
        raise ValueError(f"model directory {path!r} has a tokenizer that cannot be loaded (from "
                         f"{', '.join(files)}): {type(e).__name__}: {message}") from e


def collect_eos_token_ids(config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every EOS id the model declares: config, generation_config.json and tokenizer."""
    if config.is_gguf:
        from nanovllm.loader.gguf import gguf_eos_token_ids
        return set(gguf_eos_token_ids(config.model_path, tokenizer))
    ids = set(_as_list(getattr(config.hf_config, "eos_token_id", None)))
    gen_file = os.path.join(config.model_path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            ids.update(_as_list(json.load(f).get("eos_token_id")))
    ids.update(_as_list(tokenizer.eos_token_id))
    return ids


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
