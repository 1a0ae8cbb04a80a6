"""`nanovllm bench`: its workloads are the ones specified, and a run prints both engines'
figures with their ratios and draws the concurrency plot; a twin (bench_twins) has its shape's
tensors, loads in both engines and is cached; the W2 table's bandwidth bound; the contention
neighbour ends with the run. Speed itself is never asserted here: a benchmark is not a test."""

import argparse
import contextlib
import dataclasses
import math
import os
import random
import re
import sys
import time

import pytest

from conftest import requires_default_model
from nanovllm.entrypoints import bench, bench_llama_cpp, bench_twins
from nanovllm.loader.gguf import gguf_block_types, iter_gguf_weights, load_gguf_config


def test_workloads_are_drawn_as_specified():
    """W1: 64 prompts of 64-512 ids below 10,001 and outputs of 32-256 tokens at temperature 0.6,
    the same draw every run: its totals are the ones every W1 figure in benchmarks/RESULTS.md was
    measured on. W2: a fixed prompt of the asked length."""
    w1 = bench.throughput_workload()
    assert len(w1.prompts) == len(w1.max_tokens) == 64 and w1.temperature == 0.6 and w1.schema is None
    assert all(64 <= len(p) <= 512 and 0 <= min(p) and max(p) <= 10000 for p in w1.prompts)
    assert all(32 <= n <= 256 for n in w1.max_tokens)
    assert (w1.prompt_tokens, w1.output_tokens) == (17896, 9528)
    assert bench.throughput_workload() == w1
    w2 = bench.latency_prompt()
    assert len(w2) == 128 and 0 <= min(w2) and max(w2) <= 10000 and bench.latency_prompt() == w2
    assert len(bench.latency_prompt(512)) == 512


@pytest.fixture
def small_workloads(monkeypatch):
    """W1 and W2 shrunk to the tiny model's vocabulary and context, same code paths."""
    rng = random.Random(0)
    w1 = bench.Workload([[rng.randrange(300) for _ in range(rng.randint(8, 40))] for _ in range(64)],
                        [rng.randint(2, 12) for _ in range(64)], 0.6)
    monkeypatch.setattr(bench, "throughput_workload", lambda: w1)
    monkeypatch.setattr(bench, "latency_prompt", lambda length: [rng.randrange(300) for _ in range(length)])
    monkeypatch.setattr(bench, "W2_INPUT_LEN", 16)  # the defaults of --input-len and --output-len
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


@pytest.mark.parametrize("engine", ["llama.cpp", "ik_llama.cpp"])
def test_the_llama_cpp_comparisons_need_a_gguf_file(tiny_checkpoint, engine):
    with pytest.raises(SystemExit, match=f"--compare {engine} runs GGUF files"):
        bench.llama_cpp_runner(engine, str(tiny_checkpoint("LlamaForCausalLM")))


def test_without_ik_llama_cpp_the_error_says_what_to_install(twin_cache, monkeypatch):
    from nanovllm.entrypoints.bench_ik_llama_cpp import IkLlamaCppRunner
    monkeypatch.setitem(sys.modules, "ik_llama_cpp", None)  # its import fails
    with pytest.raises(SystemExit, match="--compare ik_llama.cpp needs ik-llama-cpp-python: pip install"):
        IkLlamaCppRunner(str(twin_cache / "absent.gguf"), 1, 2, 256)


def test_ik_llama_cpp_runs_the_workloads_loop(twin_cache):
    """Several sequences at once, greedy and sampled, the cache cleared between calls: every
    request gets its tokens, each a token of the vocabulary (greedy: the logits' argmax)."""
    pytest.importorskip("ik_llama_cpp")
    pytest.importorskip("llama_cpp")  # builds the twin
    from nanovllm.entrypoints.bench_ik_llama_cpp import IkLlamaCppRunner
    runner = IkLlamaCppRunner(bench_twins.build_twin(bench_twins.parse_twin("tiny-llama:Q8_0")), 1, 3, 256)
    drawn = []
    sampling = runner._sampling

    @contextlib.contextmanager
    def recording(temperature, seed=0):
        with sampling(temperature, seed) as sample:
            def record(row):  # the token, and the logits' argmax beside it
                drawn.append((temperature, sample(row), runner._logits(row).argmax()))
                return drawn[-1][1]
            yield record
    runner._sampling = recording
    try:
        for temperature in (0.0, 0.6, 0.0):
            runner.generate([[1, 2, 3], list(range(5, 70)), [9]], [4, 3, 5], temperature)
    finally:
        runner.close()
    assert len(drawn) == 3 * 12 and all(0 <= token < 320 for _, token, _ in drawn)
    assert all(token == best for temperature, token, best in drawn if temperature == 0)
    assert [t for _, t, _ in drawn[:12]] == [t for _, t, _ in drawn[24:]]  # a cleared cache: the same greedy run


@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_a_comparison_engine_runs_in_its_own_process_as_its_users_run_it(twin_cache, monkeypatch, user_policy):
    """No torch in its process and the user's OpenMP policy, not the one nano-vllm sets for torch;
    it runs requests, reports a failed one and keeps serving, and is reaped at close."""
    pytest.importorskip("llama_cpp")
    import nanovllm
    from nanovllm.entrypoints.bench_engine_process import EngineProcess
    monkeypatch.setattr(nanovllm, "_USER_OMP_WAIT_POLICY", user_policy)
    path = bench_twins.build_twin(bench_twins.parse_twin("tiny-llama:F16"))  # F16: see the neighbour's test
    engine = EngineProcess("llama.cpp", path, 1, 2, 256)
    try:
        assert (engine.openmp_wait_policy, engine.torch_loaded) == (user_policy, False)
        assert engine.dtype == "the file's types" and engine.startup_s > 0
        engine.generate([[1, 2, 3], [4, 5]], [3, 2], 0.6)
        with pytest.raises(RuntimeError, match="llama.cpp failed in its process"):
            engine.generate([list(range(1, 300))], [2], 0.0)  # past its 256-token sequence
        engine.generate([[7, 8]], [4], 0.0)
    finally:
        engine.close()
    assert engine.process.returncode == 0


def test_an_engine_that_cannot_start_says_why(twin_cache):
    pytest.importorskip("llama_cpp")
    from nanovllm.entrypoints.bench_engine_process import EngineProcess
    with pytest.raises(SystemExit, match="llama.cpp could not load .*absent.gguf"):
        EngineProcess("llama.cpp", str(twin_cache / "absent.gguf"), 1, 2, 256)


def test_bench_structured_w1_against_plain(tiny_checkpoint, small_workloads, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoint("LlamaForCausalLM")), "--dtype", "float32",
                              "--workload", "w1-json", "--threads", "2"])
    assert bench.main(args) == 0  # the runner asserts every request made its max_tokens under the schema
    table = capsys.readouterr().out.split("W1-JSON structured outputs")[1]
    rows = [line[2:18].strip() for line in table.splitlines()[2:] if line.strip()]
    assert rows == ["W1", "W1-JSON", "W1-JSON / W1"]


# --- random-weight twins (bench_twins), the bandwidth bound, contention ---------------------------

TINY_TWINS = {  # the table's fields at a test's size; qwen3's head_dim is not hidden / heads
    "tiny-llama": bench_twins.TwinShape("llama", 64, 128, 2, 4, 2, 16, 320, 10000.0, 1e-5, 256, True),
    "tiny-qwen2": bench_twins.TwinShape("qwen2", 64, 128, 2, 4, 2, 16, 320, 10000.0, 1e-6, 256, True),
    "tiny-qwen3": bench_twins.TwinShape("qwen3", 64, 128, 2, 4, 2, 32, 320, 10000.0, 1e-6, 256, False),
    "tiny-gemma3": bench_twins.TwinShape("gemma3", 64, 128, 2, 4, 2, 32, 320, 10000.0, 1e-6, 256, True, 8),
    "tiny-qwen3moe": bench_twins.TwinShape("qwen3moe", 64, 128, 2, 4, 2, 32, 320, 10000.0, 1e-6, 256, True, None,
                                           4, 2, 32),
}


@pytest.fixture
def twin_cache(tmp_path, monkeypatch):
    """The tiny shapes in the table, the user cache in a temporary directory."""
    for name, shape in TINY_TWINS.items():
        monkeypatch.setitem(bench_twins.SHAPES, name, shape)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "nanovllm" / "bench-twins"


@pytest.mark.parametrize("name", TINY_TWINS)
def test_a_twin_has_its_shape_and_runs_in_the_engine(twin_cache, name):
    from nanovllm import LLM, SamplingParams
    shape = TINY_TWINS[name]
    path = bench_twins.build_twin(bench_twins.parse_twin(f"{name}:F16"))
    assert path == str(twin_cache / f"{name}-F16.gguf") and os.listdir(twin_cache) == [f"{name}-F16.gguf"]
    config = load_gguf_config(path)
    assert config.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                     "qwen3moe": "Qwen3MoeForCausalLM"}[shape.architecture]]
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size, rope["rope_theta"],
            config.rms_norm_eps, config.max_position_embeddings, config.tie_word_embeddings,
            getattr(config, "sliding_window", None), getattr(config, "num_experts", 0),
            getattr(config, "num_experts_per_tok", 0), getattr(config, "moe_intermediate_size", 0)) == \
        pytest.approx(dataclasses.astuple(shape)[1:])  # the file's floats are float32
    weights = dict(iter_gguf_weights(path))
    hidden, q, kv = shape.hidden_size, shape.num_attention_heads * shape.head_dim, 2 * shape.head_dim
    layer = {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
             "mlp.gate_proj.weight": (128, hidden), "mlp.up_proj.weight": (128, hidden),
             "mlp.down_proj.weight": (hidden, 128), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    gemma3 = {"self_attn.q_norm.weight": (32,), "self_attn.k_norm.weight": (32,),
              "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,)}
    experts = {f"mlp.experts.{e}.{p}_proj.weight": (hidden, 32) if p == "down" else (32, hidden)
               for e in range(4) for p in ("gate", "up", "down")}
    if shape.num_experts:
        layer = {k: v for k, v in layer.items() if not k.startswith("mlp.")} | experts | {"mlp.gate.weight": (4, hidden)}
    layer |= {"qwen2": {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)},
              "qwen3": {"self_attn.q_norm.weight": (32,), "self_attn.k_norm.weight": (32,)},
              "qwen3moe": {"self_attn.q_norm.weight": (32,), "self_attn.k_norm.weight": (32,)},
              "gemma3": gemma3}.get(shape.architecture, {})
    expected = {"model.embed_tokens.weight": (320, hidden), "model.norm.weight": (hidden,)}
    expected |= {} if shape.tie_word_embeddings else {"lm_head.weight": (320, hidden)}
    expected |= {f"model.layers.{i}.{k}": v for i in range(2) for k, v in layer.items()}
    assert {k: tuple(w.shape) for k, w in weights.items()} == expected
    up = "mlp.experts.3.up_proj" if shape.num_experts else "mlp.up_proj"
    assert 0.015 < weights[f"model.layers.1.{up}.weight"].std() < 0.025  # random, not zeros
    llm = LLM(path, dtype="float32", enforce_eager=True, num_kvcache_blocks=16, max_model_len=64)
    assert len(llm.llm_engine.tokenizer) == 320
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3moe"])
def test_a_quantized_twin_loads_in_both_engines_and_is_reused(twin_cache, monkeypatch, name):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = bench_twins.build_twin(bench_twins.parse_twin(f"{name}:Q8_0"))
    assert sorted(os.listdir(twin_cache)) == [f"{name}-F16.gguf", f"{name}-Q8_0.gguf"]  # no partial left
    # Every matrix quantized to the type asked (but a router, which llama.cpp keeps in F32).
    assert set(gguf_block_types(path).values()) == {"Q8_0"} and not any(".gate." in n for n in gguf_block_types(path))
    load_gguf_config(path)
    model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
    assert model and llama_cpp.llama_model_n_params(model) > 0
    llama_cpp.llama_model_free(model)
    monkeypatch.setattr(bench_twins, "quantize", None)  # a second build must not call it
    monkeypatch.setattr(bench_twins, "write_f16_twin", None)
    assert bench_twins.build_twin(bench_twins.parse_twin(f"{name}:Q8_0")) == path


def test_a_failed_write_leaves_no_file(twin_cache, monkeypatch):
    def fail(shape, path):
        open(path, "wb").write(b"half a file")
        raise RuntimeError("disk full")
    monkeypatch.setattr(bench_twins, "write_f16_twin", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        bench_twins.build_twin(bench_twins.parse_twin("tiny-llama:F16"))
    assert os.listdir(twin_cache) == []


def test_twins_are_cached_by_shape_and_type(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    twin = bench_twins.parse_twin("qwen3-0.6b:Q4_K_M")
    assert twin == bench_twins.Twin("qwen3-0.6b", "Q4_K_M")
    assert bench_twins.twin_path(twin) == str(tmp_path / "nanovllm" / "bench-twins" / "qwen3-0.6b-Q4_K_M.gguf")


def test_the_shapes_are_the_real_models():
    # Each model's published parameter count (safetensors' total, the tied embedding once).
    real = {"smollm2-135m": 134_515_008, "smollm2-1.7b": 1_711_376_384, "qwen3-0.6b": 596_049_920,
            "llama-3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768, "gemma-3-1b": 999_885_952,
            "gemma-3-1b-as-llama": 999_885_952 - 26 * (2 * 1152 + 2 * 256)}  # less Gemma's extra norms
    # The mixture of experts sized to these machines, and its dense twin of the same active size:
    # per layer 5,245,184 of attention and norms, then a router and 64 experts of 3 x 256 x 1024,
    # or one MLP of 3 x 2048 x 1024; the tied embedding 151,936 x 1024, the final norm 1024.
    designed = {"qwen3-moe-1.7b-a0.3b": 28 * (5_245_184 + 64 * 1024 + 64 * 3 * 256 * 1024) + 155_582_464 + 1024,
                "qwen3-moe-1.7b-a0.3b-as-dense": 28 * (5_245_184 + 3 * 2048 * 1024) + 155_582_464 + 1024}
    assert {name: sum(map(math.prod, bench_twins.tensor_shapes(shape).values()))
            for name, shape in bench_twins.SHAPES.items()} == real | designed
    moe = bench_twins.SHAPES["qwen3-moe-1.7b-a0.3b"]
    assert moe.active_share() == 8 / 64 and bench_twins.tensor_shapes(moe)["blk.0.ffn_down_exps.weight"] == (64, 1024, 256)
    shapes = bench_twins.tensor_shapes(bench_twins.SHAPES["qwen2.5-0.5b"])
    assert shapes["blk.23.attn_k.bias"] == (128,) and shapes["token_embd.weight"] == (151936, 896)
    assert "output.weight" not in shapes  # tied


@pytest.mark.parametrize("spec, message", [
    ("qwen9-1t:Q4_K_M", "unknown twin shape 'qwen9-1t'; shapes: smollm2-135m, smollm2-1.7b, qwen3-0.6b"),
    ("qwen3-0.6b:Q3_K_Z", "unknown twin type 'Q3_K_Z' (SHAPE:TYPE); types: F16, Q4_K_M, Q4_0"),
    ("qwen3-0.6b", "unknown twin type ''"),
])
def test_unknown_twins_are_answered_with_the_list(spec, message, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        bench_twins.parse_twin(spec)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--twin", spec])
    assert message in capsys.readouterr().err


def test_twin_and_contention_parse():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--twin", "qwen3-0.6b:Q4_K_M", "--contention"])
    assert args.twin == bench_twins.Twin("qwen3-0.6b", "Q4_K_M") and args.contention
    args = parser.parse_args([])
    assert args.twin is None and not args.contention


def test_without_llama_cpp_the_errors_say_what_to_install(twin_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # its import fails
    with pytest.raises(SystemExit, match="--twin tiny-llama:Q4_K_M needs llama-cpp-python: pip install"):
        bench_twins.build_twin(bench_twins.parse_twin("tiny-llama:Q4_K_M"))
    assert not twin_cache.exists()  # checked before the F16 file is written
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit, match="--contention needs llama-cpp-python"):
        bench.main(parser.parse_args(["--contention"]))


def test_w2_takes_its_lengths_from_the_options(tiny_checkpoint, small_workloads, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    model = str(tiny_checkpoint("LlamaForCausalLM"))
    args = parser.parse_args(["--model", model, "--workload", "w2", "--input-len", "24", "--output-len", "4",
                              "--num-kvcache-blocks", "16"])
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "W2 latency: 1 request, 24 prompt tokens, 4 greedy output tokens" in out
    ttft, prompt_rate = out.split("W2 latency")[1].splitlines()[2].split()[1:3]  # nano-vllm's row
    ttft = float(ttft)  # printed to the millisecond: the rate is 24 tokens over a TTFT in that interval
    assert 24 / (ttft + 0.0005) <= float(prompt_rate) <= 24 / max(ttft - 0.0005, 1e-9)
    with pytest.raises(SystemExit, match="--output-len at least 2"):
        bench.main(parser.parse_args(["--model", model, "--output-len", "1"]))


def _gguf_with(path, arch: str, tensors: dict[str, tuple[int, ...]], **experts) -> str:
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), arch)
    if experts:
        writer.add_expert_count(experts["count"])
        writer.add_expert_used_count(experts["used"])
    for name, shape in tensors.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_the_decode_bound_counts_a_tokens_bytes_of_the_file(tmp_path):
    """The whole file for a dense model; of a mixture of experts, the experts a token takes."""
    dense = _gguf_with(tmp_path / "dense.gguf", "llama", {"token_embd.weight": (8, 32)})
    size = os.path.getsize(dense)
    assert bench.decode_bound_tok_s(dense, size * 200 / 1e9) == pytest.approx(200)
    assert bench.decode_bound_tok_s(str(tmp_path), 1.0) is None  # a Hugging Face directory
    moe = _gguf_with(tmp_path / "moe.gguf", "qwen3moe", {"token_embd.weight": (8, 32),
                                                         "blk.0.ffn_up_exps.weight": (4, 8, 32)}, count=4, used=1)
    assert bench.decode_bytes(moe) == os.path.getsize(moe) - 4 * 8 * 32 * 4 * 3 / 4


def test_the_w2_table_gives_each_decode_rate_share_of_the_bound(capsys):
    bound = 200.0
    bench.print_latency({"nano-vllm": bench.Latency(0.1, 150.0), "llama.cpp": bench.Latency(0.1, 100.0)}, bound)
    out = capsys.readouterr().out
    assert [line.split() for line in out.splitlines()[3:6]] == [
        ["nano-vllm", "0.100", "1280.0", "150.0", "75%"], ["llama.cpp", "0.100", "1280.0", "100.0", "50%"],
        ["vs", "llama.cpp", "1.00x", "1.00x", "1.50x"]]
    assert "bound: 200.0 tok/s" in out and "caches" not in out
    bench.print_latency({"nano-vllm": bench.Latency(0.1, 300.0)}, bound)
    out = capsys.readouterr().out  # a rate past the bound is shown, and said to come from the caches
    assert "150%" in out and "above it, part of the file stays in the CPU's caches" in out
    assert bench.read_bandwidth_gbs() > 0


def test_the_contention_neighbour_runs_and_is_gone_after(twin_cache):
    pytest.importorskip("llama_cpp")
    # F16: llama-cpp-python 0.3.36 built natively on an Intel Xeon (AMX) VM crashed on every quantized
    # file (its AMX path), which would be llama.cpp's failure, not the neighbour's.
    path = bench_twins.build_twin(bench_twins.parse_twin("tiny-llama:F16"))
    with pytest.raises(RuntimeError, match="the run failed"):
        with bench_llama_cpp.busy_neighbour(path, 1) as pid:
            time.sleep(0.5)
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split()[2] in "RSD"  # running (or between tokens), not exited
            raise RuntimeError("the run failed")
    assert not os.path.exists(f"/proc/{pid}")  # terminated and reaped, even on the error


def test_w2_takes_the_engines_repeats_in_turn(monkeypatch):
    """A slow spell of a shared machine must fall on every engine alike: W2's timed requests go
    round the engines, and each figure is its engine's median."""
    calls = []
    clock = [0.0]

    class Runner:
        def __init__(self, name, ttft, per_token):
            self.name, self.ttft, self.per_token = name, ttft, per_token

        def generate(self, prompts, max_tokens, temperature):
            calls.append((self.name, max_tokens[0]))
            clock[0] += self.ttft + self.per_token * (max_tokens[0] - 1)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    latencies = bench.run_latencies([Runner("a", 0.5, 0.01), Runner("b", 0.25, 0.02)], 16, 9)
    timed = calls[2:]  # after one warm-up each
    assert calls[:2] == [("a", 1), ("b", 1)]
    assert timed == [("a", 1), ("a", 9), ("b", 1), ("b", 9)] * bench.W2_REPEATS
    assert latencies["a"].ttft_s == pytest.approx(0.5) and latencies["a"].decode_tok_s == pytest.approx(100)
    assert latencies["b"].ttft_s == pytest.approx(0.25) and latencies["b"].decode_tok_s == pytest.approx(50)


@requires_default_model
def test_the_copy_workload_runs_with_and_without_speculation(small_workloads, monkeypatch, capsys):
    monkeypatch.setattr(bench, "COPY_OUTPUT_LEN", 12)
    monkeypatch.setattr(bench, "COPY_REPEATS", 1)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--workload", "copy", "--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 3}', "--max-model-len", "1024"])
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    copy_table, w2_table = out.split("COPY: 5 copy-heavy chats, one at a time, 12 greedy output tokens")[1] \
        .split("W2 latency")
    rows = [line.split()[0] for line in copy_table.splitlines()[2:] if line.strip()]
    assert rows[:3] == ["nano-vllm+ngram", "nano-vllm", "vs"]
    accepted, drafted = map(int, re.search(r"(\d+) of (\d+) drafted tokens accepted", copy_table).groups())
    assert 0 < accepted <= drafted
    assert [line.split()[0] for line in w2_table.splitlines()[2:4]] == ["nano-vllm+ngram", "nano-vllm"]
