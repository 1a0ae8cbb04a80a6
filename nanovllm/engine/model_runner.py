"""Runs the model for one scheduled batch: builds the flat step tensors, runs the forward
pass under the attention backend's metadata, computes logits only for the positions
that sample, and samples.

It also owns the model weights and the paged KV cache (one tensor each for K and V per
layer, in the attention backend's layout, sliced into the attention layers).
"""

import contextlib
import ctypes
import logging
import os
import time

import numpy as np
import torch

from nanovllm.attention.base import BatchLayout, forward_context
from nanovllm.attention.selector import make_attention_backend
from nanovllm.config import CPU_KV_CACHE_RAM_SHARE, EngineConfig
from nanovllm.distributed.parallel_state import SINGLE, TPGroup
from nanovllm.engine.cuda_graph import CUDAGraphRunner
from nanovllm.engine.gpu_memory import profile_kv_cache_bytes, warmup_batch
from nanovllm.engine.inductor_rounding import UnfuseReducedPrecisionAddmm
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.kernels.cpu import use_elementwise_kernels
from nanovllm.layers.attention import Attention
from nanovllm.layers.linear import pack_weights_for_cpu
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingBatch, top_logprobs
from nanovllm.loader.weights import load_weights
from nanovllm.models.registry import get_model_class

GiB = 1 << 30
logger = logging.getLogger(__name__)


def compile_on_cpu(config: EngineConfig, device: torch.device, tp_group: TPGroup) -> bool:
    """torch.compile is the CPU's answer to CUDA graphs: it fuses the elementwise ops around
    the matmuls and removes most per-op dispatch. Off with enforce_eager, and in fp32, which
    stays the exact reference path (the tests' parity with transformers runs there, eager and
    fast to start); tensor parallelism runs eager (collectives inside the graph are not worth
    a compile on CPU)."""
    return (device.type == "cpu" and not config.enforce_eager and config.torch_dtype != torch.float32
            and tp_group.world_size == 1)


# One object for every compile: Dynamo reuses a graph only for an equal backend, and the pass
# compares by identity.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "post_grad_custom_post_pass": UnfuseReducedPrecisionAddmm()}


def compile_with_dynamic_tokens(module: torch.nn.Module) -> None:
    """torch.compile `module`'s forward with the leading (token) dim of its tensor arguments
    dynamic and everything else static. The token dim is marked unbacked, a size the compiler
    may not specialise on (not even 1, which it otherwise gives a graph of its own), so one graph
    serves every step; static shapes elsewhere keep the guards cheap (the cache never resizes).

    emulate_precision_casts: the fused kernels round to bf16 wherever the eager code does (after
    the residual add, the norm, RoPE, SiLU). Without it Inductor keeps fused intermediates in
    fp32; each layer drifts from eager by a bf16 ulp or so, and over 30 layers that turned the
    default model's near-tied first token of "What is the capital of France?" ("The" against
    "L", 0.08 nats apart in fp32) the wrong way. With it, and with matmuls rounded before the
    residual add as eager rounds them (see inductor_rounding), a layer's output equals eager's
    up to the order of the norm's sum (see test_compiled_layers_round_like_eager)."""
    compiled = torch.compile(module.forward, fullgraph=True, options=COMPILE_OPTIONS)

    def forward(*args):
        for arg in args:
            torch._dynamo.decorators.mark_unbacked(arg, 0)
        return compiled(*args)

    module.forward = forward


# Decoder layers per compiled call. Each call into a compiled graph costs ~80 us of Python and
# Dynamo on these CPUs, 30 times a step with one layer a call (~2.4 ms of a ~12 ms
# single-sequence decode step). Two layers a call halve that (a 128-token request 1.79 ->
# 1.63 s) and divide every usual layer count; more saves less and compiles longer (~0.8 s a
# layer more per graph).
LAYERS_PER_GRAPH = 2


class LayerGroup(torch.nn.Module):
    """Consecutive decoder layers as one call, (positions, hidden, residual) -> (hidden, residual):
    the unit compiled on CPU."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor):
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden, residual


def keep_freed_memory_mapped() -> None:
    """Stop glibc's malloc from handing freed memory back to the kernel between steps.

    By default every allocation over 128 KB to 32 MB (it adapts) is its own mmap, and the heap's
    free top is trimmed, so each prefill step's activations (MBs each) come back as fresh pages
    that fault in and are zeroed: ~40,000 page faults in a 2,048-token step of the default
    model, a second of kernel time over the throughput benchmark. A fixed 32 MB mmap threshold
    (glibc's most) and no trimming keep those pages in the heap for the next step; the process
    then holds its peak activations, which max_num_batched_tokens bounds. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: mallopt's option numbers below are glibc's
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_group: TPGroup = SINGLE):
        self.config = config
        self.tp_group = tp_group
        self.device = torch.device(config.device)
        self.block_size = config.kvcache_block_size
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        self.model = self._load_model()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        first = self.attn_layers[0]
        self.backend = make_attention_backend(self.device, config.torch_dtype, first.num_heads, first.num_kv_heads,
                                              first.head_dim, self.block_size)
        self.num_kvcache_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.cuda_graphs = None  # decode steps replay captured graphs when set
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs:
            self.cuda_graphs = CUDAGraphRunner(self.model, self.backend, config.max_num_seqs, config.max_model_len,
                                               self.block_size, self.device)
            self.cuda_graphs.capture()
        self.compile_seconds = 0.0
        self.compiled = compile_on_cpu(config, self.device, tp_group)
        if self.compiled:
            self._compile()
        self.sampler = Sampler()
        self.eos_token_ids: set[int] = set()  # set by the engine; min_tokens holds these back
        self.generator = torch.Generator(self.device).manual_seed(config.seed)

    def _load_model(self) -> torch.nn.Module:
        config = self.config
        model_cls = get_model_class(config.hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                model = model_cls(config.hf_config, self.tp_group)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.is_gguf:
            from nanovllm.loader.gguf import iter_gguf_weights
            weights = iter_gguf_weights(config.model_path, config.torch_dtype)
        else:
            from nanovllm.loader.safetensors import iter_safetensors
            weights = iter_safetensors(config.model_path)
        load_weights(model, weights)
        if self.device.type == "cpu":
            pack_weights_for_cpu(model)
            use_elementwise_kernels(model, config.torch_dtype)
        return model.eval()

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
        elif self.device.type == "cuda":
            budget = profile_kv_cache_bytes(self.model, self.attn_layers, self.backend, config, self.device)
            num_blocks = budget // per_block
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            # No point holding more than max_num_seqs full-length sequences can use.
            num_blocks = min(int(available * CPU_KV_CACHE_RAM_SHARE) // per_block,
                             config.max_num_seqs * -(-config.max_model_len // self.block_size))
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
        elif self.device.type == "cpu":  # uninitialised costs nothing until a page is first written
            from nanovllm.kernels.cpu import empty_in_huge_pages
            self.k_cache, self.v_cache = (empty_in_huge_pages(shape, dtype) for _ in range(2))
        else:
            self.k_cache, self.v_cache = (torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2))
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]

    def _compile(self) -> None:
        """Compile the decoder layers with torch.compile, LAYERS_PER_GRAPH at a time, now rather
        than in the first request.

        Groups of layers, not the whole model: every group of every model of one shape shares a
        single compiled graph (parameters and cache are graph inputs), so 30 layers compile once
        (a last, shorter group would add a graph) and a second engine in the same process
        compiles nothing; the whole model as one graph compiles for 35-39 s. The token count is
        dynamic, and attention is one opaque op and the linear op picks its kernel by row count
        at run time, so one graph serves prefill, decode and mixed steps alike.
        """
        start = time.perf_counter()
        model = self.model.model
        model.layer_runs = [LayerGroup(model.layers[i:i + LAYERS_PER_GRAPH])
                            for i in range(0, len(model.layers), LAYERS_PER_GRAPH)]
        for group in model.layer_runs:
            compile_with_dynamic_tokens(group)
        # One token, written into slot 0 of block 0: garbage there is harmless, since a block's
        # slots are always written by the sequence that owns them before anything reads them.
        # Its tensors are made under inference_mode, as a step's are: the guards tell inference
        # tensors apart, and a warm-up on others compiled a graph no step runs.
        with torch.inference_mode():
            input_ids, positions, layout = warmup_batch(1, self.config.max_model_len, 1, self.block_size, self.device)
            with forward_context(self.backend, self.backend.prepare(layout)):
                self.model(input_ids, positions)
        self.compile_seconds = time.perf_counter() - start
        logger.info("compiled the decoder layers for CPU in %.1f s", self.compile_seconds)

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
            block_tables[i, :len(seq.block_table)] = seq.block_table
        seq_of_token = np.repeat(np.arange(len(batch)), num_new)
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1] - starts, num_new)
        slots = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        layout = BatchLayout(
            query_lens=list(batch.num_new_tokens),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(dev),
            cu_seqlens_q=torch.from_numpy(cu_seqlens.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=int(num_new.max()),
            max_context_len=int(context_lens.max()),
        )
        return torch.tensor(input_ids, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev), layout

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Run one step; returns one sampled token per sequence that samples, in batch order."""
        input_ids, positions, layout = self._prepare(batch)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(layout):
            hidden = self.cuda_graphs.run(input_ids, positions, layout)
        else:
            metadata = self.backend.prepare(layout)
            with forward_context(self.backend, metadata), self._guard_stance():
                hidden = self.model(input_ids, positions)
        return self._sample(batch, hidden)

    def survives(self, error: Exception) -> bool:
        """Whether further steps can run after `error` escaped `execute`: yes for a fault of the
        step's own inputs (the engine then fails just those requests); no after a device error,
        which may leave the CUDA context unusable."""
        return not isinstance(error, torch.AcceleratorError)

    def _guard_stance(self):
        """With compiled layers: Dynamo checks only the guards that tell its cached graphs apart
        (none, with one graph), not all of each graph's guards on every layer call: ~0.7 ms of a
        12 ms decode step. The skipped guards could only catch a step whose inputs differ from
        the warm-up's in _compile, and none does: it ran a step's kind of inputs (inference
        tensors, an unbacked token count) through every layer, and steps pass the same dtypes,
        devices and static shapes. Engines of other shapes in the process compile their own
        graphs at their own warm-up (guards on), which the remaining guards tell apart; a step
        that matched no graph would raise, not recompile. The stance is Dynamo's process-wide
        setting: compiled code of the user's running in another thread during a step skips its
        guards too."""
        if self.compiled:
            return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
        return contextlib.nullcontext()

    def _sample(self, batch: ScheduledBatch, hidden: torch.Tensor) -> SamplerOutput:
        """Logits only for the rows that need them: the last row of each sampling sequence,
        and the prompt rows of a sequence that asked for prompt logprobs. Then sample."""
        sample_rows, sample_seqs, prompt_spans, end = [], [], [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = end, end + n
            if seq.wants_prompt_logprobs:
                # Row start + j predicts the token at position num_computed + j + 1.
                first = seq.num_computed_tokens + 1
                count = min(n, seq.num_prompt_tokens - first)
                if count > 0:
                    prompt_spans.append((seq, first, start, count))
            if batch.samples(i):
                sample_rows.append(end - 1)
                sample_seqs.append(seq)
        rows = [r for _, _, start, count in prompt_spans for r in range(start, start + count)] + sample_rows
        if not rows:
            return SamplerOutput([], [])
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        if logits is None:  # a non-zero tensor-parallel rank: rank 0 samples
            return SamplerOutput([], [])
        num_prompt_rows = len(rows) - len(sample_rows)
        out = SamplerOutput([], [])
        if sample_seqs:
            sampling = SamplingBatch.build(sample_seqs, logits.shape[1], self.eos_token_ids, logits.device)
            out = self.sampler(logits[num_prompt_rows:], sampling, self.generator)
        out.prompt_logprobs = self._prompt_logprobs(prompt_spans, logits[:num_prompt_rows])
        return out

    @staticmethod
    def _prompt_logprobs(spans, logits: torch.Tensor) -> list:
        """(seq, first position, [(logprob, rank, top pairs)] per position) for each span."""
        result, offset = [], 0
        for seq, first, _, count in spans:
            logprobs = torch.log_softmax(logits[offset:offset + count].float(), dim=-1)
            offset += count
            targets = torch.tensor(seq.token_ids[first:first + count], device=logits.device)
            num = seq.sampling_params.prompt_logprobs
            chosen, ranks, top = top_logprobs(logprobs, targets, num)
            top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top else ([[]] * count, [[]] * count)
            entries = [(lp, rank, list(zip(ids, lps)))
                       for lp, rank, ids, lps in zip(chosen.tolist(), ranks.tolist(), top_ids, top_lps)]
            result.append((seq, first, entries))
        return result
