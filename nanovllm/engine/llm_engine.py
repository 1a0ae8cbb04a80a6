"""The engine: validates and tokenizes requests (giving each sequence its stop checker), steps
scheduler and model runner, and turns sampled tokens into outputs (logprobs, incremental text).

`add_request` / `step` / `abort_request` is the streaming interface the CLI and the server
use; `step` returns a RequestOutput for every request that advanced, with cumulative text. A
pooling model's engine (runner="pooling") takes PoolingParams instead, and its `step` returns
an EmbeddingRequestOutput for every request whose prompt was pooled.
"""

import logging
from itertools import count

import torch

from nanovllm.startup import phase as startup_phase
from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.draft_model import DraftModel, check_same_tokenizer
from nanovllm.engine.executor import make_executor
from nanovllm.engine.scheduler import ScheduledBatch, Scheduler
from nanovllm.engine.sampler import SamplerOutput, TokenLogprobs
from nanovllm.engine.sequence import Request
from nanovllm.engine.speculation import Speculation
from nanovllm.engine.stop import StopChecker
from nanovllm.engine.structured_output import StructuredOutputs
from nanovllm.layers.pooler import PoolerOutput
from nanovllm.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PositionLogprobs,
                              RequestOutput)
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams, check_text

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        with startup_phase("tokenizer"):
            self.tokenizer = config.checkpoint.tokenizer()
        self.eos_token_ids = config.checkpoint.eos_token_ids(config.hf_config, self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        self.pooling = config.runner == "pooling"  # one engine either pools or generates
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.vocab_size, self.eos_token_ids,
            forbid_undeclared_properties=config.structured_outputs_config["disable_additional_properties"])
        if config.device == "cpu":
            torch.set_num_threads(config.num_threads)  # the kernels' pool and torch's both follow it
        draft = config.draft_config  # speculative decoding's draft model, if it has one
        if draft is not None:
            with startup_phase("draft model's tokenizer"):
                check_same_tokenizer(self.tokenizer, draft.checkpoint.tokenizer(), config.speculative_config.model)
        self.executor = make_executor(config)
        # Speculative decoding's drafts and their bookkeeping, if the engine speculates.
        self.speculation = None
        if config.speculative_config is not None:
            draft_model = None
            if draft is not None:
                with startup_phase("draft model"):
                    draft_model = DraftModel(draft, self.executor.num_kvcache_blocks, self.vocab_size)
            self.speculation = Speculation(config.speculative_config, config.max_model_len, draft_model)
        self.block_manager = BlockManager(self.executor.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, self.executor.kv_sliding_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._request_ids = count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_tokens_computed = 0  # prompt (and recomputed) tokens run through the model
        self.decode_tokens_computed = 0

    # ----- requests -----

    def make_request(self, prompt, sampling_params: SamplingParams | PoolingParams,
                     request_id: str | None = None) -> Request:
        """Validate and tokenize one prompt; raises ValueError before anything is queued.
        `sampling_params` is a PoolingParams for a pooling model."""
        if request_id is None:
            request_id = str(next(self._request_ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(sampling_params, PoolingParams):
            if not self.pooling:
                raise ValueError(NOT_POOLING)
            sampling_params.check_against_model(self.config.hf_config.hidden_size)
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(sampling_params).__name__}")
        elif self.pooling:
            raise ValueError(NOT_GENERATING)
        else:
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
        if self.pooling:
            return self._pooling_request(request_id, text, token_ids, sampling_params)
        max_tokens = sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - len(token_ids)
            if max_tokens < 1:
                raise ValueError(f"prompt ({len(token_ids)} tokens) leaves no room to generate within "
                                 f"max_model_len={max_len}")
        elif len(token_ids) + max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) "
                             f"= {len(token_ids) + max_tokens} exceeds max_model_len={max_len}")

        def stop_checker() -> StopChecker:
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, sampling_params)
            return StopChecker(sampling_params, max_tokens, max_len, self.eos_token_ids, detokenizer)

        make_grammar = None
        constraint = sampling_params.structured_outputs
        if constraint is not None:
            compiled = self.structured_outputs.compile(constraint)  # a schema or grammar it rejects fails here
            make_grammar = lambda: self.structured_outputs.new_state(compiled)  # noqa: E731
        return Request(request_id, text, token_ids, sampling_params, stop_checker, make_grammar)

    def _pooling_request(self, request_id: str, text: str | None, token_ids: list[int],
                         params: PoolingParams) -> Request:
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) exceeds max_model_len={self.config.max_model_len}")
        request = Request(request_id, text, token_ids, None, pooling_params=params)
        request.seqs[0].pools_every_position = self.config.pooler_config.reads_every_position
        return request

    def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams | PoolingParams) -> Request:
        request = self.make_request(prompt, sampling_params, request_id)
        self.enqueue(request)
        return request

    def enqueue(self, request: Request):
        """Queue a request made by make_request."""
        self.requests[request.request_id] = request
        self.prompt_tokens += len(request.prompt_token_ids)
        for seq in request.seqs:
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
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        try:
            out = self.executor.execute(batch)
        except Exception as error:
            if not self.executor.survives(error):
                raise
            return self._fail_step(batch, error)
        if self.pooling:
            return self._pooled(batch, out)
        # A decode computes its last token and any drafts after it.
        num_decode = sum(n for seq, n, drafts in zip(batch.seqs, batch.num_new_tokens, batch.drafts)
                         if n == 1 + len(drafts) and seq.num_computed_tokens >= seq.num_prompt_tokens)
        self.decode_tokens_computed += num_decode
        self.prefill_tokens_computed += batch.num_tokens - num_decode
        self._record_prompt_logprobs(batch, out)
        # A step that verified drafts: each sampling sequence's drafted tokens, for the bookkeeping.
        drafted = ([len(batch.drafts[i]) for i in range(len(batch)) if batch.samples(i)]
                   if out.num_tokens is not None else None)
        advanced = self.scheduler.postprocess(batch, out.token_ids, out.num_tokens)
        emitted = out.num_tokens or [1] * len(advanced)
        first = 0  # of the sequence's tokens in out.token_ids / out.logprobs
        for (seq, appended), num_emitted in zip(advanced, emitted):
            self.generation_tokens += appended
            for j, logprobs in enumerate(out.logprobs[first:first + appended]):
                if logprobs is not None:
                    token = seq.token_ids[seq.num_tokens - appended + j]
                    seq.logprobs.append(self._position_logprobs(token, logprobs))
                    seq.cumulative_logprob += logprobs.chosen_logprob
            first += num_emitted
        if drafted is not None:
            for (seq, _), num_emitted, num_drafted in zip(advanced, emitted, drafted):
                self.speculation.record(seq, num_drafted, num_emitted)
        requests = {seq.request_id: self.requests[seq.request_id] for seq, _ in advanced}
        outputs = [self._output(request) for request in requests.values()]
        for request in requests.values():
            if request.finished:
                if self.speculation is not None:
                    for seq in request.seqs:
                        self.speculation.finished(seq)
                self._forget(request)
        return outputs

    def _pooled(self, batch: ScheduledBatch, out: PoolerOutput) -> list[EmbeddingRequestOutput]:
        """A pooling step's outputs: its requests whose prompts were pooled, which are done."""
        self.prefill_tokens_computed += batch.num_tokens
        pooled = self.scheduler.postprocess_pooled(batch)
        outputs = []
        for seq, embedding in zip(pooled, out.embeddings, strict=True):
            request = self.requests[seq.request_id]
            outputs.append(self._embedding_output(request, embedding))
            self._forget(request)
        return outputs

    def _embedding_output(self, request: Request, embedding: list[float]) -> EmbeddingRequestOutput:
        seq = request.seqs[0]
        return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(embedding), request.prompt_token_ids,
                                      finished=seq.is_finished, prompt=request.prompt,
                                      finish_reason=seq.finish_reason)

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

    def _record_prompt_logprobs(self, batch: ScheduledBatch, out: SamplerOutput):
        for span in out.prompt_logprobs:
            seq, first = batch.seqs[span.batch_index], span.first_position
            # After a preemption the prompt is recomputed: keep only positions not yet recorded.
            skip = len(seq.prompt_logprobs) - first
            for position, entry in enumerate(span.logprobs[skip:], start=first + skip):
                seq.prompt_logprobs.append(self._position_logprobs(seq.token_ids[position], entry))

    def _position_logprobs(self, token: int, entry: TokenLogprobs) -> PositionLogprobs:
        result = {tid: Logprob(lp, rank, self.tokenizer.decode([tid]))
                  for rank, (tid, lp) in enumerate(entry.top, start=1)}
        if token not in result:
            result[token] = Logprob(entry.chosen_logprob, entry.rank, self.tokenizer.decode([token]))
        return result

    def _output(self, request: Request) -> RequestOutput | EmbeddingRequestOutput:
        if request.pooling_params is not None:  # an abort or a failed step: no vector
            return self._embedding_output(request, [])
        completions = []
        for seq in request.seqs:
            text = seq.stop_checker.detokenizer.output_text(seq.is_finished)
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
            **(self.speculation.metrics() if self.speculation is not None else {}),
        }


NOT_POOLING = ("this model was not started as a pooling model, so it cannot embed; start it with "
               "runner='pooling' (--runner pooling)")
NOT_GENERATING = ("this model was started as a pooling model (runner='pooling'): it embeds (LLM.embed, "
                  "/v1/embeddings) and cannot generate")


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
