"""CUDA-graph decode: buckets cover every batch size, persistent buffers are sized from
max_model_len, and padded lanes change nothing (checked by running the model eagerly over
the padded buffers with the Triton backend; on CPU under Triton's interpreter). Capture and
replay themselves need CUDA."""

import random
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_checkpoint, triton_skip_reason
from nanovllm import LLM, SamplingParams
from nanovllm.attention.base import BatchLayout, forward_context
from nanovllm.attention.selector import BACKEND_ENV
from nanovllm.platforms.cuda_graph import PAD_SLOT, CUDAGraphRunner, DecodeInputs, graph_batch_sizes, select_bucket

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8, 9, 16, 17, 100, 256, 257, 300, 1000])
def test_buckets_cover_every_batch_size(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        bucket = select_bucket(sizes, n)
        assert n <= bucket <= max_num_seqs
        assert bucket - n <= (7 if n <= 256 else 31)  # padding stays small
    assert select_bucket(sizes, max_num_seqs + 1) is None


def test_bucket_list_shape():
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and len(graph_batch_sizes(256)) == 35


def decode_layout(context_lens: list[int], tables: list[list[int]], block_size: int) -> tuple:
    n = len(context_lens)
    width = max(map(len, tables))
    block_tables = torch.full((n, width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t)
    slots = [t[(c - 1) // block_size] * block_size + (c - 1) % block_size for c, t in zip(context_lens, tables)]
    layout = BatchLayout([1] * n, torch.tensor(context_lens, dtype=torch.int32),
                         torch.arange(n + 1, dtype=torch.int32), torch.tensor(slots), block_tables, 1,
                         max(context_lens))
    return torch.tensor([5 + i for i in range(n)]), torch.tensor(context_lens) - 1, layout


def test_buffers_are_sized_from_max_model_len_and_padded():
    inputs = DecodeInputs.allocate(8, max_model_len=100, block_size=16, device=torch.device("cpu"))
    assert inputs.block_tables.shape == (8, 7)  # ceil(100 / 16) blocks per sequence
    assert inputs.input_ids.shape == inputs.slot_mapping.shape == inputs.context_lens.shape == (8,)
    assert inputs.cu_seqlens_q.tolist() == list(range(9))

    ids, positions, layout = decode_layout([3, 40, 17, 100], [[4], [0, 2, 9], [1, 3], [5, 6, 7, 8, 10, 11, 12]], 16)
    inputs.load(ids, positions, layout, bucket=4)
    pointers = {t.data_ptr() for t in (inputs.input_ids, inputs.slot_mapping, inputs.context_lens)}
    ids, positions, layout = decode_layout([7, 33], [[1], [6, 2, 8]], 16)
    inputs.load(ids, positions, layout, bucket=4)  # fewer sequences than last time: lanes 2, 3 re-padded
    assert {t.data_ptr() for t in (inputs.input_ids, inputs.slot_mapping, inputs.context_lens)} == pointers
    assert inputs.input_ids[:4].tolist() == [5, 6, 0, 0]
    assert inputs.positions[:4].tolist() == [6, 32, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [22, 128, PAD_SLOT, PAD_SLOT]
    assert inputs.context_lens[:4].tolist() == [7, 33, 0, 0]
    assert inputs.block_tables[1, :3].tolist() == [6, 2, 8]

    graph_layout = inputs.layout(4)
    assert graph_layout.context_lens.data_ptr() == inputs.context_lens.data_ptr()  # aliases, not copies
    assert graph_layout.block_tables.shape == (4, 7) and graph_layout.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert graph_layout.max_query_len == 1 and graph_layout.max_context_len == 100


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("graph"), "Qwen3ForCausalLM", head_dim=24)


def first_decode_step(llm, prompts):
    """Prefill the prompts in one step, then schedule (without running) their first decode step."""
    engine = llm.llm_engine
    for prompt in prompts:
        engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    return engine.scheduler.schedule()


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_padded_lanes_write_nowhere_and_change_no_output(checkpoint, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    llm = LLM(str(checkpoint), dtype="float32", device=DEVICE, num_kvcache_blocks=32, max_model_len=128,
              max_num_seqs=8)
    runner = llm.llm_engine.executor
    rng = random.Random(0)
    batch = first_decode_step(llm, [[rng.randrange(300) for _ in range(n)] for n in (5, 17, 40)])
    input_ids, positions, layout = runner._prepare(batch)
    assert layout.max_query_len == 1 and len(batch) == 3

    with forward_context(runner.backend, runner.backend.prepare(layout)):
        eager = runner.model(input_ids, positions)
    k_cache, v_cache = runner.k_cache.clone(), runner.v_cache.clone()

    inputs = DecodeInputs.allocate(8, 128, runner.block_size, runner.device)
    inputs.load(input_ids, positions, layout, bucket=4)
    with forward_context(runner.backend, runner.backend.prepare(inputs.layout(4))):
        padded = runner.model(inputs.input_ids[:4], inputs.positions[:4])
    # The real lanes rewrote their own slots (with the same values, up to rounding); the
    # padded lane wrote nothing.
    for cache, before in ((runner.k_cache, k_cache), (runner.v_cache, v_cache)):
        flat, flat_before = cache.flatten(1, 2), before.flatten(1, 2)  # [layers, slots, kv_heads, head_dim]
        written = layout.slot_mapping
        torch.testing.assert_close(flat[:, written], flat_before[:, written], atol=1e-5, rtol=1e-5)
        flat[:, written] = flat_before[:, written]
        assert torch.equal(flat, flat_before)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()


class EagerReplay(CUDAGraphRunner):
    """CUDAGraphRunner without CUDA: each bucket's "graph" reruns the model over the
    persistent buffers into the output captured for it, which is what a replay does."""

    def capture(self) -> None:
        self.replays = []
        for bucket in self.sizes:
            hidden = self.forward(bucket)
            self.graphs[bucket] = (SimpleNamespace(replay=partial(self._replay, bucket, hidden)), hidden)

    def _replay(self, bucket: int, hidden: torch.Tensor) -> None:
        self.replays.append(bucket)
        hidden.copy_(self.forward(bucket))


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_decode_steps_through_the_graph_buffers_give_the_eager_tokens(checkpoint, monkeypatch):
    """The model runner's graph path (bucket choice, buffer loading, padding as the batch
    shrinks, output slicing) with replay done eagerly, so it runs without CUDA."""
    monkeypatch.setenv(BACKEND_ENV, "triton")
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 3, 5, 5, 6, 8)]
    tokens = []
    for graphs in (False, True):
        # Eager layers: the replay's buffers are the CUDA path's, which the CPU's compiled
        # layers were never warmed up on. On a GPU the same runs there: Triton under its
        # interpreter only when there is no CUDA, and compiled Triton rejects host tensors.
        llm = LLM(str(checkpoint), dtype="float32", device=DEVICE, num_kvcache_blocks=32, max_model_len=64,
                  max_num_seqs=6, enforce_eager=True)
        runner = llm.llm_engine.executor
        if graphs:
            runner.cuda_graphs = EagerReplay(runner.model, runner.backend, 6, 64, runner.block_size, runner.device)
            runner.cuda_graphs.capture()
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[1] == tokens[0]
    # Decode batches of 6, 5 (padded to 6), 4, 2 and 1 sequences replayed.
    assert set(runner.cuda_graphs.replays) == {6, 4, 2, 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graph_replay_gives_the_eager_tokens(checkpoint):
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(rng.randint(1, 60))] for _ in range(13)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for enforce_eager in (True, False):
        llm = LLM(str(checkpoint), dtype="float32", device="cuda", num_kvcache_blocks=64, max_model_len=128,
                  max_num_seqs=13, enforce_eager=enforce_eager)
        runner = llm.llm_engine.executor
        assert (runner.cuda_graphs is None) == enforce_eager
        if not enforce_eager:
            assert sorted(runner.cuda_graphs.graphs) == [1, 2, 4, 8, 13]
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        # Sequences finish together here, so also run batch sizes between buckets (3, 5, 11).
        for n in (3, 5, 11):
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts[:n], params, use_tqdm=False)])
    half = len(results) // 2
    assert results[:half] == results[half:]
