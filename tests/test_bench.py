"""`nanovllm bench`: its workloads are the ones specified, and a run prints both engines'
figures with their ratios and draws the concurrency plot. Speed itself is never asserted
here: a benchmark is not a test."""

import argparse
import random

import pytest

from nanovllm.entrypoints import bench


def test_workloads_are_drawn_as_specified():
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(64, 512))] for _ in range(64)]
    max_tokens = [random.randint(32, 256) for _ in range(64)]
    w1 = bench.throughput_workload()
    assert (w1.prompts, w1.max_tokens, w1.temperature) == (prompts, max_tokens, 0.6)
    rng = random.Random(1)
    assert bench.latency_prompt() == [rng.randint(0, 10000) for _ in range(128)]


@pytest.fixture
def small_workloads(monkeypatch):
    """W1 and W2 shrunk to the tiny model's vocabulary and context, same code paths."""
    rng = random.Random(0)
    w1 = bench.Workload([[rng.randrange(300) for _ in range(rng.randint(8, 40))] for _ in range(64)],
                        [rng.randint(2, 12) for _ in range(64)], 0.6)
    monkeypatch.setattr(bench, "throughput_workload", lambda: w1)
    monkeypatch.setattr(bench, "latency_prompt", lambda: [rng.randrange(300) for _ in range(16)])
    monkeypatch.setattr(bench, "W2_OUTPUT_LEN", 8)
    return w1


def test_bench_compares_with_transformers_and_plots(tiny_checkpoint, small_workloads, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    plot = tmp_path / "concurrency.png"
    args = parser.parse_args(["--model", str(tiny_checkpoint("LlamaForCausalLM")), "--dtype", "float32",
                              "--compare", "transformers", "--plot", str(plot), "--threads", "2"])
    assert not args.enable_prefix_caching  # repeats would time the cache, not the model
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    w1 = small_workloads
    assert f"W1 throughput: 64 requests, {w1.prompt_tokens} prompt + {w1.output_tokens} output tokens" in out
    w1_table, w2_table = out.split("W1 throughput")[1].split("W2 latency")
    for table in (w1_table, w2_table):
        rows = [line[2:18].strip() for line in table.splitlines()[2:] if line.strip()][:3]
        assert rows == ["nano-vllm", "transformers", "vs transformers"]
    for n in bench.PLOT_CONCURRENCY:
        assert f"{n:>3} concurrent:" in out
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_llama_cpp_comparison_needs_a_gguf_file(tiny_checkpoint):
    with pytest.raises(SystemExit, match="runs GGUF files"):
        bench.llama_cpp_runner(str(tiny_checkpoint("LlamaForCausalLM")))


def test_bench_structured_w1_against_plain(tiny_checkpoint, small_workloads, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoint("LlamaForCausalLM")), "--dtype", "float32",
                              "--workload", "w1-json", "--threads", "2"])
    assert bench.main(args) == 0  # the runner asserts every request made its max_tokens under the schema
    table = capsys.readouterr().out.split("W1-JSON structured outputs")[1]
    rows = [line[2:18].strip() for line in table.splitlines()[2:] if line.strip()]
    assert rows == ["W1", "W1-JSON", "W1-JSON / W1"]
