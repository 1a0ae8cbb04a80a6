"""Runs the model for one scheduled batch: builds the flat step tensors, runs the forward
pass under the attention backend's metadata, computes logits only for the positions
that sample, and samples; or, for a pooling model, pools each prompt's hidden states.

It also owns the model weights and the paged KV cache (one tensor each for K and V per
layer, in the attention backend's layout, sliced into the attention layers).
"""

import logging

import numpy as np
import torch

from nanovllm.attention.base import BatchLayout, forward_context
from nanovllm.attention.selector import forced_backend, make_attention_backend
from nanovllm.config import EngineConfig
from nanovllm.distributed.parallel_state import SINGLE, TPGroup
from nanovllm.engine.sampler import PromptLogprobs, Sampler, SamplerOutput, SamplingBatch, token_logprobs
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.structured_output import grammar_bitmask
from nanovllm.engine.transfer import to_device
from nanovllm.layers.attention import Attention
from nanovllm.layers.build_context import built_for
from nanovllm.layers.pooler import Pooler, PoolerOutput
from nanovllm.layers.quantization.chooser import LinearMethodChooser
from nanovllm.loader.pooling_view import PoolingModelView
from nanovllm.loader.weights import load_weights
from nanovllm.models.registry import get_model_class
from nanovllm.platforms import get_platform
from nanovllm.platforms.gpu_memory import warmup_batch
from nanovllm.startup import phase as startup_phase

GiB = 1 << 30
logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_group: TPGroup = SINGLE, max_kvcache_blocks: int | None = None):
        """`max_kvcache_blocks`: at most this many KV blocks, whatever memory allows (a draft model's
        cache needs no more than its target's)."""
        self.config = config
        self.max_kvcache_blocks = max_kvcache_blocks
        self.tp_group = tp_group
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        self.platform = get_platform(self.device, config.torch_dtype, config.enforce_eager, tp_group)
        self.model = self._load_model()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self.attn_layers[0]
        backend_name = forced_backend() or self.platform.attention_backend(first.head_dim, self.block_size)
        self.backend = make_attention_backend(backend_name, first.num_heads, first.num_kv_heads, first.head_dim,
                                              self.block_size)
        with startup_phase("KV cache"):
            self.num_kvcache_blocks = self._num_kv_blocks()
            self._allocate_kv_cache()
        # Decode steps replay captured graphs when the platform gives a runner for them; a pooling
        # model's steps are all prefill, so it captures none.
        pooling = config.runner == "pooling"
        self.cuda_graphs = None if pooling else self.platform.graph_runner(self.model, self.backend, config)
        with startup_phase("compile and warm-up"):
            self.compile_seconds = self.platform.compile(self.model, self._warmup)
        self.sampler = Sampler(self.platform.sampling_ops())
        # A pooling model's: every step pools instead of sampling.
        self.pooler = Pooler(config.pooler_config) if pooling else None
        self.generator = torch.Generator(self.device).manual_seed(config.seed)

    def _load_model(self) -> torch.nn.Module:
        config = self.config
        model_cls = get_model_class(config.hf_config)
        pooling = config.runner == "pooling"
        checkpoint = PoolingModelView(config.checkpoint) if pooling else config.checkpoint
        default_dtype = torch.get_default_dtype()
        with startup_phase("model and weights"):
            linear_methods = LinearMethodChooser(self.platform, checkpoint.block_types(config.quantization),
                                                 model_cls.packed_modules_mapping,
                                                 getattr(model_cls, "expert_params_mapping", None))
            torch.set_default_dtype(config.torch_dtype)
            try:
                with torch.device(self.device), built_for(self.platform):
                    model = model_cls(config.hf_config, self.tp_group, linear_methods, with_lm_head=not pooling)
            finally:
                torch.set_default_dtype(default_dtype)
            linear_methods.log_dequantized()
            load_weights(model, checkpoint.weights(config.torch_dtype, linear_methods.kept_in_blocks))
        with startup_phase("repack weights for the platform"):
            for module in model.modules():  # each once: a tied head is its embedding module
                if hasattr(module, "linear_method"):
                    module.linear_method.process_weights_after_loading(module)
                if hasattr(module, "moe_method"):
                    module.moe_method.process_weights_after_loading(module)
            self.platform.prepare_model(model)
        return model.eval()

    @property
    def kv_sliding_window(self) -> int | None:
        """The window every attention layer slides over, or None where some layer sees the whole
        context: what the block manager may free behind."""
        windows = {layer.sliding_window for layer in self.attn_layers}  # 0: a layer without one
        if len(windows) != 1 or 0 in windows:
            return None
        return windows.pop()

    @property
    def kv_bytes_per_block(self) -> int:
        first = self.attn_layers[0]
        elem = torch.empty(0, dtype=self.config.torch_dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * first.num_kv_heads * first.head_dim * elem

    def _num_kv_blocks(self) -> int:
        config = self.config
        per_block = self.kv_bytes_per_block
        if config.num_kvcache_blocks is not None:
            num_blocks = config.num_kvcache_blocks
        elif config.kv_cache_memory_gb is not None:
            num_blocks = int(config.kv_cache_memory_gb * GiB) // per_block
        else:
            budget = self.platform.kv_cache_budget_bytes(self.model, self.attn_layers, self.backend, config)
            # No point holding more than max_num_seqs full-length sequences can use (and a small
            # model on a large GPU would otherwise get millions of blocks, each a Python object).
            num_blocks = min(budget // per_block, config.max_num_seqs * -(-config.max_model_len // self.block_size))
        if self.max_kvcache_blocks is not None:
            num_blocks = min(num_blocks, self.max_kvcache_blocks)
        # Ranks may see different free memory; all must agree (and fail alike below).
        num_blocks = self.tp_group.min_over_ranks(num_blocks)
        needed = -(-config.max_model_len // self.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, but one sequence of "
                f"max_model_len={config.max_model_len} tokens needs {needed} blocks "
                f"({needed * per_block / GiB:.3f} GiB); give more memory (kv_cache_memory_gb / "
                f"num_kvcache_blocks / gpu_memory_utilization) or lower max_model_len")
        return num_blocks

    def _allocate_kv_cache(self):
        shape = (len(self.attn_layers), *self.backend.kv_cache_shape(self.num_kvcache_blocks))
        dtype = self.config.torch_dtype
        if self.backend.needs_zeroed_cache:  # padded lanes read unused slots, and 0 * NaN garbage is NaN
            self.k_cache, self.v_cache = (torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2))
        else:
            self.k_cache, self.v_cache = (self.platform.empty_kv_cache(shape, dtype, self.device) for _ in range(2))
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]

    def _warmup(self) -> None:
        """One token, written into slot 0 of block 0: garbage there is harmless, since a block's
        slots are always written by the sequence that owns them before anything reads them. Its
        tensors are made under inference_mode, as a step's are: compiled graphs' guards tell
        inference tensors apart, and a warm-up on others compiles a graph no step runs."""
        with torch.inference_mode():
            input_ids, positions, layout = warmup_batch(1, self.config.max_model_len, 1, self.block_size, self.device)
            with forward_context(self.backend, self.backend.prepare(layout)):
                self.model(input_ids, positions)

    def _prepare(self, batch: ScheduledBatch):
        """The step's flat tensors, built with whole-batch numpy ops: per sequence, only its new
        token ids and its block table are copied out of Python lists."""
        bs = self.block_size
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((seq.num_computed_tokens for seq in batch.seqs), np.int64, len(batch))
        context_lens = starts + num_new
        cu_seqlens = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu_seqlens[1:])
        block_tables = np.full((len(batch), max(len(seq.block_table) for seq in batch.seqs)), -1, dtype=np.int32)
        input_ids = []
        for i, (seq, start, end) in enumerate(zip(batch.seqs, starts.tolist(), context_lens.tolist())):
            input_ids += seq.token_ids[start:end]
            if end > seq.num_tokens:  # drafted tokens follow the sequence's own
                input_ids += batch.drafts[i][max(start - seq.num_tokens, 0):end - seq.num_tokens]
            block_tables[i, :len(seq.block_table)] = seq.block_table
        seq_of_token = np.repeat(np.arange(len(batch)), num_new)
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1] - starts, num_new)
        slots = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        layout = BatchLayout(
            query_lens=list(batch.num_new_tokens),
            context_lens=to_device(context_lens, torch.int32, dev),
            cu_seqlens_q=to_device(cu_seqlens, torch.int32, dev),
            slot_mapping=to_device(slots, torch.long, dev),
            block_tables=to_device(block_tables, torch.int32, dev),
            max_query_len=int(num_new.max()),
            max_context_len=int(context_lens.max()),
        )
        return to_device(input_ids, torch.long, dev), to_device(positions, torch.long, dev), layout

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput | PoolerOutput:
        """Run one step; returns one sampled token per sequence that samples, in batch order (a
        pooling model: one vector per sequence whose prompt ends this step)."""
        hidden = self._forward(batch)
        if self.pooler is not None:
            return self._pool(batch, hidden)
        return self._sample(batch, hidden)

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The batch's rows through the model (a captured graph where one fits): hidden states."""
        input_ids, positions, layout = self._prepare(batch)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(layout):
            return self.cuda_graphs.run(input_ids, positions, layout)
        with forward_context(self.backend, self.backend.prepare(layout)):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def greedy_next(self, batch: ScheduledBatch, allowed: torch.Tensor | None = None) -> list[int]:
        """A draft model's step: run the batch and return each sequence's most likely next token
        after its last row (its drafts so far included), among the tokens `allowed` gives it (a
        grammar bitmask a sequence, as grammar_bitmask makes them) where given."""
        hidden = self._forward(batch)
        last_rows = np.cumsum(batch.num_new_tokens) - 1
        logits = self.model.compute_logits(hidden[to_device(last_rows, torch.long, hidden.device)])
        if allowed is not None:
            self.sampler.ops.mask_disallowed(logits, to_device(allowed, torch.int32, logits.device))
        return logits.argmax(dim=-1).tolist()

    def _pool(self, batch: ScheduledBatch, hidden: torch.Tensor) -> PoolerOutput:
        """Carry each sequence's pooling state over its rows; a sequence whose prompt ends this
        step gets its vector. Rank 0 pools (every rank holds the same whole hidden states)."""
        if self.tp_group.rank != 0:
            return PoolerOutput([])
        vectors, end = [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = end, end + n
            rows = hidden[start:end]
            seq.pooling_state = self.pooler.accumulate(seq.pooling_state, rows, seq.num_computed_tokens)
            if batch.samples(i):
                vectors.append(self.pooler.finish(seq.pooling_state, rows, seq.num_tokens, seq.pooling_params))
        if not vectors:
            return PoolerOutput([])
        # One copy to the host for the step's vectors.
        flat = torch.cat(vectors).cpu()
        return PoolerOutput([v.tolist() for v in flat.split([len(v) for v in vectors])])

    def survives(self, error: Exception) -> bool:
        """Whether further steps can run after `error` escaped `execute`: yes for a fault of the
        step's own inputs (the engine then fails just those requests); no after a device error,
        which may leave the CUDA context unusable."""
        return not isinstance(error, torch.AcceleratorError)

    def _sample(self, batch: ScheduledBatch, hidden: torch.Tensor) -> SamplerOutput:
        """Logits only for the rows that need them: the last row of each sampling sequence,
        and the prompt rows of a sequence that asked for prompt logprobs. Then sample."""
        sample_rows, sample_seqs, row_drafts, prompt_spans, end = [], [], [], [], 0
        drafted = []  # (sequence, its drafts) of each sampling sequence, in batch order
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = end, end + n
            if seq.wants_prompt_logprobs:
                # Row start + j predicts the token at position num_computed + j + 1.
                first = seq.num_computed_tokens + 1
                count = min(n, seq.num_prompt_tokens - first)
                if count > 0:
                    prompt_spans.append((i, seq, first, start, count))
            if batch.samples(i):
                # A row per drafted token (its drafts before it in the context), then the row after them.
                drafts = batch.drafts[i]
                drafted.append((seq, drafts))
                for j in range(len(drafts) + 1):
                    sample_rows.append(end - 1 - len(drafts) + j)
                    sample_seqs.append(seq)
                    row_drafts.append(drafts[:j])
        # Before anything waits on the device: on a GPU the grammars' masks are filled on the
        # host while the forward pass still runs there.
        # A drafted row is masked by its grammar as it stands after the drafts before the row.
        allowed = grammar_bitmask([seq.grammar.after(drafts) if seq.grammar is not None else None
                                   for seq, drafts in zip(sample_seqs, row_drafts)], self.config.hf_config.vocab_size)
        # Prompt rows' logits before the sampled rows', in batch order (eval-kl reads them so).
        prompt_logprobs = self._prompt_logprobs(prompt_spans, hidden)
        out = SamplerOutput([], [])
        if sample_rows:
            logits = self.model.compute_logits(hidden[to_device(sample_rows, torch.long, hidden.device)])
            if logits is not None:  # None on a non-zero tensor-parallel rank: rank 0 samples
                sampling = SamplingBatch.build(
                    [seq.sampling_params for seq in sample_seqs],
                    # The context a row samples in; a copy only for a drafted row.
                    [seq.token_ids + drafts if drafts else seq.token_ids for seq, drafts in zip(sample_seqs, row_drafts)],
                    [seq.num_prompt_tokens for seq in sample_seqs],
                    [seq.stop_checker.banned_token_ids(seq.num_completion_tokens + len(drafts))
                     for seq, drafts in zip(sample_seqs, row_drafts)],
                    [seq.generator for seq in sample_seqs], logits.shape[1], logits.device, allowed)
                if len(sample_rows) > len(drafted):  # some sequence drafted
                    streams = {seq.seq_id: seq.generator.get_state() for seq, drafts in drafted
                               if drafts and seq.generator is not None}
                    out = _verified(self.sampler(logits, sampling, self.generator), drafted, streams)
                else:
                    out = self.sampler(logits, sampling, self.generator)
        out.prompt_logprobs = prompt_logprobs
        return out

    def _prompt_logprobs(self, spans, hidden: torch.Tensor) -> list[PromptLogprobs]:
        """The logprobs of each span's prompt tokens, from the span's rows of `hidden`. Logits
        are made max_num_seqs rows at a time, as many as a sampling step makes, so a long
        prompt's logprobs fit in the memory that the warm-up measured (gpu_memory.py)."""
        result = []
        chunk = self.config.max_num_seqs
        for i, seq, first, start, count in spans:
            entries = []
            for offset in range(0, count, chunk):
                n = min(chunk, count - offset)
                logits = self.model.compute_logits(hidden[start + offset:start + offset + n])
                if logits is None:  # a non-zero tensor-parallel rank
                    continue
                logprobs = torch.log_softmax(logits, dim=-1)
                targets = to_device(seq.token_ids[first + offset:first + offset + n], torch.long, logits.device)
                entries += token_logprobs(logprobs, targets, [seq.sampling_params.prompt_logprobs] * n)
            if entries:
                result.append(PromptLogprobs(i, first, entries))
        return result


def _verified(rows: SamplerOutput, drafted: list[tuple], streams: dict[int, torch.Tensor]) -> SamplerOutput:
    """The tokens each sampling sequence emits, from its rows' samples: its drafts while each
    equals the token sampled before it, then the first sample that differs (or, all accepted,
    the last row's); engine/speculation.py says why that keeps the target's distribution.
    `drafted`: (sequence, drafts) of each sampling sequence, in batch order; `streams`: the
    random streams of the seeded ones with drafts, as they were before sampling."""
    tokens, logprobs, counts, row = [], [], [], 0
    for seq, drafts in drafted:
        sampled = rows.token_ids[row:row + len(drafts) + 1]
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        tokens += sampled[:accepted + 1]
        logprobs += rows.logprobs[row:row + accepted + 1]
        counts.append(accepted + 1)
        row += len(drafts) + 1
        before = streams.get(seq.seq_id)
        if before is not None and not torch.equal(before, seq.generator.get_state()):
            # The sampler drew a number for every row; the stream moves on by the emitted tokens'
            # draws only, as it does without speculation.
            seq.generator.set_state(before)
            for _ in range(accepted + 1):
                torch.rand(1, generator=seq.generator)
    return SamplerOutput(tokens, logprobs, rows.prompt_logprobs, counts)
