"""How much GPU memory the KV cache may take.

The cache gets what `gpu_memory_utilization` of the device leaves after everything else:
weights, the CUDA context, other processes, and the activations of the largest step. That
peak is measured, not guessed: before the cache exists, one warm-up forward of
max_num_batched_tokens prompt tokens (and logits for max_num_seqs rows, as a full decode
step samples) runs against a one-block scratch cache. CUDA graphs, captured afterwards,
live in the headroom that a utilization below 1 leaves.
"""

import torch

from nanovllm.attention.base import AttentionBackend, BatchLayout, forward_context
from nanovllm.layers.attention import Attention


def warmup_batch(num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
    """(input_ids, positions, layout) of the largest prefill step: prompts of up to
    max_model_len tokens, at most max_num_seqs of them. Every slot lies in block 0 of a
    one-block cache: the values are garbage, only the shapes (and so the memory) matter."""
    num_seqs = min(max_num_seqs, -(-num_tokens // max_model_len))
    num_tokens = min(num_tokens, num_seqs * max_model_len)
    query_lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        query_lens.append(num_tokens % max_model_len)
    positions = torch.cat([torch.arange(n) for n in query_lens])
    cu_seqlens = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor(query_lens).cumsum(0)
    layout = BatchLayout(
        query_lens=query_lens,
        context_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens.to(device),
        slot_mapping=(positions % block_size).to(device),
        block_tables=torch.zeros(len(query_lens), -(-max(query_lens) // block_size), dtype=torch.int32,
                                 device=device),
        max_query_len=max(query_lens),
        max_context_len=max(query_lens),
    )
    return torch.zeros(num_tokens, dtype=torch.long, device=device), positions.to(device), layout


@torch.inference_mode()
def run_warmup_step(model: torch.nn.Module, attn_layers: list[Attention], backend: AttentionBackend,
                    config, device: torch.device) -> None:
    """One forward at the largest step, plus logits (and their fp32 softmax) for
    max_num_seqs rows, against a scratch cache that is unbound again afterwards."""
    scratch = torch.zeros(backend.kv_cache_shape(1), dtype=config.torch_dtype, device=device)
    for layer in attn_layers:
        layer.k_cache = layer.v_cache = scratch
    try:
        input_ids, positions, layout = warmup_batch(config.max_num_batched_tokens, config.max_model_len,
                                                    config.max_num_seqs, config.kvcache_block_size, device)
        with forward_context(backend, backend.prepare(layout)):
            hidden = model(input_ids, positions)
        if model.lm_head is not None:  # a pooling model has none, and makes no logits
            rows = torch.arange(config.max_num_seqs, device=device) % hidden.shape[0]
            logits = model.compute_logits(hidden[rows])
            if logits is not None:  # rank 0 samples
                torch.softmax(logits, dim=-1)
    finally:
        for layer in attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)


def kv_cache_budget(total: int, free: int, step_peak: int, utilization: float) -> int:
    """Bytes left for the KV cache: the utilization share of the device, less what is in use
    now (`total - free`: weights, context, other processes) and the step's activation peak."""
    return max(0, int(total * utilization) - (total - free) - step_peak)


def profile_kv_cache_bytes(model: torch.nn.Module, attn_layers: list[Attention], backend: AttentionBackend,
                           config, device: torch.device) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_warmup_step(model, attn_layers, backend, config, device)
    torch.cuda.synchronize(device)
    step_peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # hand the step's blocks back so mem_get_info sees them free
    free, total = torch.cuda.mem_get_info(device)
    return kv_cache_budget(total, free, step_peak, config.gpu_memory_utilization)
