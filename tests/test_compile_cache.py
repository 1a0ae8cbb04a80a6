"""The CPU's compiled decoder layers kept on disk: a later engine (a later start) loads the saved
graph instead of compiling, whatever its KV cache's size, and generates what a freshly compiled
engine and eager generate; a damaged file is compiled again; old files are pruned, the least
recently used first; the key tells apart what the graph depends on and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.platforms import cpu_compile

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """An empty cache directory, and no graphs in this process yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_compile, "_compiled", {})
    return tmp_path / "nanovllm" / "compiled-graphs"


@pytest.fixture
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint()


@pytest.fixture
def graph_events(monkeypatch) -> dict[str, int]:
    """How many graphs were compiled (and saved) and how many loaded from files, as they happen."""
    events = {"compiled": 0, "loaded": 0}
    load, save = cpu_compile._load, cpu_compile._save

    def counted_load(path, f_globals):
        compiled = load(path, f_globals)
        events["loaded"] += compiled is not None
        return compiled

    def counted_save(compiled, path):
        events["compiled"] += 1
        save(compiled, path)

    monkeypatch.setattr(cpu_compile, "_load", counted_load)
    monkeypatch.setattr(cpu_compile, "_save", counted_save)
    return events


def _generate(checkpoint, events: dict[str, int], num_blocks: int, **kwargs) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens from a new engine, and what its start-up compiled and loaded."""
    cpu_compile._compiled.clear()  # as in a new process: only the files remain
    before = dict(events)
    llm = LLM(str(checkpoint), dtype="float32", num_kvcache_blocks=num_blocks, **kwargs)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], {k: events[k] - before[k] for k in events}


def test_a_later_engine_loads_the_saved_graph(checkpoint, cache_home, graph_events):
    eager, _ = _generate(checkpoint, graph_events, 64, enforce_eager=True)
    compiled, did = _generate(checkpoint, graph_events, 64)
    assert did == {"compiled": 1, "loaded": 0} and len(list(cache_home.glob("*.bin"))) == 1
    loaded, did = _generate(checkpoint, graph_events, 97)  # another cache size: the same graph
    assert did == {"compiled": 0, "loaded": 1}
    assert loaded == compiled == eager


def test_a_damaged_graph_file_is_compiled_again(checkpoint, cache_home, graph_events):
    first, _ = _generate(checkpoint, graph_events, 64)
    (saved,) = cache_home.glob("*.bin")
    saved.write_bytes(b"not a graph")
    again, did = _generate(checkpoint, graph_events, 64)
    assert did == {"compiled": 1, "loaded": 0}
    assert again == first and saved.stat().st_size > len(b"not a graph")  # saved anew


def test_old_graphs_are_pruned_and_a_load_counts_as_a_use(checkpoint, cache_home, graph_events):
    _generate(checkpoint, graph_events, 64)
    (saved,) = cache_home.glob("*.bin")
    saved_at = saved.stat().st_mtime
    old = saved_at - 1000
    for i in range(cpu_compile.MAX_SAVED_GRAPHS + 3):  # graphs of other sources or models
        stale = cache_home / f"stale{i}.bin"
        stale.write_bytes(b"")
        os.utime(stale, (old + i, old + i))
    os.utime(saved, (old - 1, old - 1))  # the least recent of all, until loaded
    _, did = _generate(checkpoint, graph_events, 64)
    assert did == {"compiled": 0, "loaded": 1} and saved.stat().st_mtime >= saved_at
    cpu_compile.prune_saved_graphs(cache_home)
    kept = {p.name for p in cache_home.glob("*.bin")}
    assert len(kept) == cpu_compile.MAX_SAVED_GRAPHS and saved.name in kept
    assert "stale0.bin" not in kept and f"stale{cpu_compile.MAX_SAVED_GRAPHS + 2}.bin" in kept


class Scale(torch.nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor
        self.weight = torch.nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.factor


def test_the_key_follows_what_the_graph_depends_on():
    key = cpu_compile.graph_key(Scale(2.0), (torch.ones(3, 16),))
    assert cpu_compile.graph_key(Scale(2.0), (torch.ones(50, 16),)) == key  # the token count is dynamic
    assert cpu_compile.graph_key(Scale(3.0), (torch.ones(3, 16),)) != key  # a module's setting
    assert cpu_compile.graph_key(Scale(2.0), (torch.ones(3, 16, dtype=torch.bfloat16),)) != key
    assert cpu_compile.graph_key(Scale(2.0), (torch.ones(3, 32),)) != key
    wider = Scale(2.0)
    wider.weight = torch.nn.Parameter(torch.ones(32), requires_grad=False)
    assert cpu_compile.graph_key(wider, (torch.ones(3, 16),)) != key
