"""The portable attention backend, the reference the CPU and Triton backends are held to, against
attention written out in full: two sequences over two steps (prompts, a chunk after a cached
prefix, a decode), with and without a sliding window and a logit softcap."""

import pytest
import torch

from nanovllm.attention.base import BatchLayout
from nanovllm.attention.torch_native import TorchNativeBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 16


def written_out(q, k, v, q_positions, scale, window, softcap):
    """q [Lq, H, D] at q_positions against the sequence's keys/values k, v [Lk, KVH, D] from 0."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(k.shape[0])[None, :]
    visible = keys <= q_positions[:, None]
    if window:
        visible &= keys > q_positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def step(backend, caches, sequences, spans, window, softcap):
    """One step: sequence i contributes its tokens spans[i] = (start, end); returns each one's output."""
    q_lens = [end - start for start, end in spans]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = max(len(seq["table"]) for seq in sequences)
    tables = torch.tensor([seq["table"] + [-1] * (width - len(seq["table"])) for seq in sequences], dtype=torch.int32)
    slots = torch.tensor([seq["table"][p // BLOCK] * BLOCK + p % BLOCK
                          for seq, (start, end) in zip(sequences, spans) for p in range(start, end)])
    layout = BatchLayout(q_lens, torch.tensor([end for _, end in spans], dtype=torch.int32), cu, slots, tables,
                         max(q_lens), max(end for _, end in spans))
    cat = lambda name: torch.cat([seq[name][start:end] for seq, (start, end) in zip(sequences, spans)])  # noqa: E731
    out = backend.forward(cat("q"), cat("k"), cat("v"), *caches, backend.prepare(layout), HEAD_DIM ** -0.5,
                          window, softcap)
    return out.split(q_lens)


@pytest.mark.parametrize("window", [0, 7, 16, 33])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_portable_attention_is_attention_written_out(window, softcap):
    gen = torch.Generator().manual_seed(0)
    sequences = []
    for length, blocks in ((50, [5, 2, 7, 0]), (21, [3, 6])):
        seq = {name: torch.randn(length, HEADS if name == "q" else KV_HEADS, HEAD_DIM, generator=gen)
               for name in ("q", "k", "v")}
        seq["table"] = blocks
        sequences.append(seq)
    backend = TorchNativeBackend(HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    caches = [torch.zeros(backend.kv_cache_shape(8)) for _ in range(2)]
    for spans in ([(0, 30), (0, 20)], [(30, 50), (20, 21)]):  # prompts; a chunk after 30 cached and a decode
        for seq, (start, end), out in zip(sequences, spans, step(backend, caches, sequences, spans, window, softcap)):
            expected = written_out(seq["q"][start:end], seq["k"][:end], seq["v"][:end], torch.arange(start, end),
                                   HEAD_DIM ** -0.5, window, softcap)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
