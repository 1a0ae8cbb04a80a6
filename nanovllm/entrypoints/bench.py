"""`nanovllm bench`: the CPU benchmark workloads, optionally side by side with transformers and
llama.cpp (bench_llama_cpp).

W1 (throughput): 64 random-id prompts of 64-512 tokens, 32-256 output tokens each, temperature
0.6, EOS ignored, all submitted at once (seed 0; nano-vllm's bench shape scaled to 2 cores).
W1-JSON (structured outputs): W1 again, every request under one JSON schema (STRUCTURED_SCHEMA),
nano-vllm only; its output tok/s against plain W1's from the same run is the constraint's cost.
W2 (latency): one 128-token random prompt (seed 1), 128 greedy output tokens (`--input-len`,
`--output-len`, as vLLM's latency benchmark); reports the time to first token, the prompt's tokens
over it (a prompt-processing rate, llama-bench's pp512 at `--input-len 512`), and the decode rate
of the tokens after it.

Every engine runs the same token ids in one run, one after the other, so their ratio means
something even on a noisy machine (absolute figures from different runs hardly do); llama.cpp and
ik_llama.cpp each run in a process of their own (bench_engine_process), as their users run them. Each
workload gets one untimed warm-up. The engine runs without prefix caching by default: warm-up
and repeats reuse prompts, and a cache hit would time the cache, not the model. Transformers
runs W1 the way its users batch: one left-padded `generate` over all concurrent requests,
running to the longest `max_tokens`; only the requested tokens count as output.

COPY (speculative decoding): the copy-heavy chats shipped with the package (copy_workload.json:
rewrite a paragraph with one change, copy a record into JSON, rename a variable in code, quote a
notice, extend a list), one at a time, 128 greedy output tokens each (EOS ignored), by nano-vllm
with `--speculative-config` (default: suffix decoding) and without, and with `--compare
llama.cpp`, by llama.cpp without and with its own prompt-lookup speculation (drafts as long as an
n-gram config's, else llama-cpp-python's default of 10 tokens); each
engine's decode rate (each chat's tokens after the first over a full request's time less a
one-token request's, summed over the chats), the drafts' acceptance, and W2 with speculation on
and off (random ids: what speculation costs where it cannot help).

`--twin SHAPE:TYPE` runs a random-weight twin of a real model (bench_twins) instead of --model.
The machine line gives the read bandwidth (a sum over a 1 GiB buffer on the engine's threads);
with a GGUF file, W2 gives each decode rate's share of the bound it sets: a decode step reads
about the whole file (every weight once, the tied embedding as the output head; of a mixture of
experts, only the chosen experts' share), so an engine reading it from memory decodes no faster
than bandwidth / those bytes (a file not much larger than the CPU's caches can pass it). `--contention` runs the workloads beside a busy llama.cpp
neighbour (bench_llama_cpp); the bandwidth is measured before it starts.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import torch

from nanovllm.entrypoints.bench_engine_process import EngineProcess
from nanovllm.entrypoints.bench_llama_cpp import busy_neighbour, require_llama_cpp
from nanovllm.entrypoints.bench_twins import SHAPES, TYPES, build_twin, parse_twin
from nanovllm.entrypoints.engine_args import add_engine_arguments, engine_kwargs
from nanovllm.loader.default_model import DEFAULT_MODEL_ALIAS

W1_NUM_REQUESTS = 64
W2_INPUT_LEN = W2_OUTPUT_LEN = 128  # the defaults of --input-len and --output-len
W2_REPEATS = 5
PLOT_CONCURRENCY = (1, 4, 16, 64)
BANDWIDTH_BUFFER_BYTES = 1 << 30  # far past the caches, so the sum reads memory
BANDWIDTH_PASSES = 5
# An array of records with strings, numbers, an enum and a nested array: structure and free text
# alike. It cannot close within W1's 256 tokens (minItems), so every request still produces its
# max_tokens and the run differs from plain W1 by the constraint alone.
STRUCTURED_SCHEMA = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "additionalProperties": False,
              "required": ["id", "name", "city", "score", "tags"],
              "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                             "city": {"enum": ["Paris", "London", "Tokyo", "Lagos", "Lima"]},
                             "score": {"type": "number"},
                             "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}},
}


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    schema: dict | None = None  # every request's output held to this JSON schema

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> "Workload":
        return Workload(self.prompts[:n], self.max_tokens[:n], self.temperature, self.schema)


def throughput_workload() -> Workload:
    """W1, drawn exactly as the issue specifies (the order of the draws matters)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(64, 512))] for _ in range(W1_NUM_REQUESTS)]
    max_tokens = [random.randint(32, 256) for _ in range(W1_NUM_REQUESTS)]
    return Workload(prompts, max_tokens, 0.6)


def latency_prompt(length: int = W2_INPUT_LEN) -> list[int]:
    rng = random.Random(1)
    return [rng.randint(0, 10000) for _ in range(length)]


@dataclass
class Throughput:
    seconds: float
    output_tok_s: float
    total_tok_s: float


@dataclass
class Latency:
    ttft_s: float
    decode_tok_s: float
    input_len: int = W2_INPUT_LEN

    @property
    def prompt_tok_s(self) -> float:
        return self.input_len / self.ttft_s


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class NanoRunner:
    name = "nano-vllm"

    def __init__(self, llm_kwargs: dict):
        from nanovllm import LLM
        start = time.perf_counter()
        self.llm = LLM(**llm_kwargs)
        self.startup_s = time.perf_counter() - start
        runner = self.llm.llm_engine.executor
        self.compile_s = runner.compile_seconds
        self.dtype = str(self.llm.llm_engine.config.torch_dtype).removeprefix("torch.")

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float,
                 schema: dict | None = None) -> None:
        from nanovllm import SamplingParams, StructuredOutputsParams
        constraint = StructuredOutputsParams(json=schema) if schema is not None else None
        params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, structured_outputs=constraint)
                  for n in max_tokens]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(max_tokens)


class TransformersRunner:
    name = "transformers"

    def __init__(self, model: str | None, dtype: torch.dtype):
        start = time.perf_counter()
        self.model = load_transformers_model(model, dtype)
        self.startup_s = time.perf_counter() - start
        self.compile_s = 0.0
        self.dtype = str(dtype).removeprefix("torch.")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> None:
        from transformers import GenerationConfig
        # Left padding, so every row's next token follows its own last prompt token.
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(max_tokens)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0, **sampling)
        out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + n


def load_transformers_model(model: str | None, dtype: torch.dtype):
    """The same checkpoint in transformers; a GGUF file goes through our dequantizing reader,
    so both engines run the very same weights."""
    from transformers import AutoModelForCausalLM

    from nanovllm.config import EngineConfig
    from nanovllm.loader.checkpoint import GGUFCheckpoint
    from nanovllm.loader.gguf import transformers_config
    config = EngineConfig(model=model, device="cpu", dtype="float32")  # resolves the path and HF config
    if not isinstance(config.checkpoint, GGUFCheckpoint):
        return AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype).eval()
    hf = AutoModelForCausalLM.from_config(transformers_config(config.hf_config), dtype=dtype)
    missing, unexpected = hf.load_state_dict(dict(config.checkpoint.weights(dtype)), strict=False)
    tied = config.hf_config.tie_word_embeddings
    if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
        raise ValueError(f"GGUF weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


def llama_cpp_runner(engine: str, model_path: str, w2_tokens: int = W2_INPUT_LEN + W2_OUTPUT_LEN) -> EngineProcess:
    """llama.cpp (bench_llama_cpp) or ik_llama.cpp (bench_ik_llama_cpp) on the same GGUF file,
    threads and workloads (W2's request of w2_tokens in all), in a process of its own."""
    if not model_path.endswith(".gguf"):
        raise SystemExit(f"error: --compare {engine} runs GGUF files; {model_path} is not one")
    w1 = throughput_workload()
    longest = max([len(p) + n for p, n in zip(w1.prompts, w1.max_tokens)] + [w2_tokens])
    return EngineProcess(engine, model_path, torch.get_num_threads(), len(w1.prompts), -(-longest // 256) * 256)


def run_throughput(runner, workload: Workload) -> Throughput:
    # The schema goes only to nano-vllm's runner (the one that takes it).
    extra = {"schema": workload.schema} if workload.schema is not None else {}
    warm = workload.head(2)  # untimed: first-call allocations, lazy initialisation, the schema's compilation
    runner.generate(warm.prompts, [4] * len(warm.prompts), workload.temperature, **extra)
    seconds = _timed(lambda: runner.generate(workload.prompts, workload.max_tokens, workload.temperature, **extra))
    return Throughput(seconds, workload.output_tokens / seconds,
                      (workload.prompt_tokens + workload.output_tokens) / seconds)


def run_latencies(runners: list, input_len: int = W2_INPUT_LEN, output_len: int = W2_OUTPUT_LEN) -> dict[str, Latency]:
    """Each engine's W2. TTFT: a one-token request. Decode rate: the output_len - 1 tokens after the
    first, from the time of a full request less the TTFT. Medians of W2_REPEATS after one warm-up
    (_first_and_full)."""
    prompt = latency_prompt(input_len)
    for runner in runners:
        runner.generate([prompt], [1], 0.0)
    return {name: Latency(ttft, (output_len - 1) / max(whole - ttft, 1e-9), input_len)
            for name, (ttft, whole) in _first_and_full(runners, prompt, output_len, W2_REPEATS).items()}


COPY_OUTPUT_LEN = 128
COPY_REPEATS = 3
DEFAULT_SPECULATION = {"method": "suffix"}
# llama-cpp-python's own default draft of a prompt lookup, for a method whose drafts vary in length.
LOOKUP_DEFAULT_TOKENS = 10


def copy_prompts(tokenizer) -> list[list[int]]:
    """The copy-heavy chats shipped with the package, through the model's chat template."""
    from nanovllm.llm import chat_prompt
    chats = json.loads(resources.files("nanovllm.entrypoints").joinpath("copy_workload.json").read_text())
    return [chat_prompt(tokenizer, chat["messages"])["prompt_token_ids"] for chat in chats]


def run_copy(runners: list, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Each engine's single-stream decode rate over the chats: per chat, the output_len - 1 tokens
    after the first over a full request's time less a one-token request's (medians of
    COPY_REPEATS, the engines taking turns), summed over the chats."""
    for runner in runners:  # warm-up
        runner.generate(prompts[:1], [4], 0.0)
    decode_s = {runner.name: 0.0 for runner in runners}
    for prompt in prompts:
        for name, (ttft, whole) in _first_and_full(runners, prompt, output_len, COPY_REPEATS).items():
            decode_s[name] += max(whole - ttft, 1e-9)
    return {name: len(prompts) * (output_len - 1) / seconds for name, seconds in decode_s.items()}


def _first_and_full(runners: list, prompt: list[int], output_len: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per engine, the median times of a one-token greedy request and of an output_len one, the
    engines' repeats taken in turn, so that a slow spell of a shared machine falls on all of them
    rather than on whichever engine was running through it."""
    first = {runner.name: [] for runner in runners}
    full = {runner.name: [] for runner in runners}
    for _ in range(repeats):
        for runner in runners:
            first[runner.name].append(_timed(lambda: runner.generate([prompt], [1], 0.0)))
            full[runner.name].append(_timed(lambda: runner.generate([prompt], [output_len], 0.0)))
    return {name: (statistics.median(first[name]), statistics.median(full[name])) for name in first}


def print_copy(rates: dict[str, float], num_chats: int, acceptance: str, output_len: int) -> None:
    print(f"\nCOPY: {num_chats} copy-heavy chats, one at a time, {output_len} greedy output tokens each "
          f"(median of {COPY_REPEATS})")
    rows = {name: [f"{rate:.1f}"] for name, rate in rates.items()}
    (_, nano), *others = rates.items()
    for name, other in others:
        rows[f"vs {name}"] = [_ratio(nano, other)]
    _print_table([("decode tok/s", 15)], rows)
    print(f"  {acceptance}")


def machine_summary() -> str:
    name, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = ", ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags) or "no AVX"
    return f"{name} ({isa}), {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads"


def read_bandwidth_gbs() -> float:
    """GB/s a sum over a 1 GiB buffer reads, the best of a few passes, on torch's threads (the
    engine's, once it has started)."""
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4)  # written, so no pass pays for first touches
    return BANDWIDTH_BUFFER_BYTES / min(_timed(buffer.sum) for _ in range(BANDWIDTH_PASSES)) / 1e9


def decode_bytes(model_path: str) -> float:
    """The bytes of a GGUF file a decode token reads: every weight once (the tied embedding as the
    output head), but of a mixture of experts only the share of the experts a token takes."""
    from nanovllm.loader.gguf_reader import read_gguf_header
    header = read_gguf_header(model_path)
    size = os.path.getsize(model_path)
    arch = header.metadata.get("general.architecture")
    experts = header.metadata.get(f"{arch}.expert_count", 0)
    if not experts:
        return size
    expert_bytes = sum(t.data.nbytes for t in header.tensors.values() if "_exps." in t.name)
    return size - expert_bytes * (1 - header.metadata[f"{arch}.expert_used_count"] / experts)


def decode_bound_tok_s(model_path: str, bandwidth_gbs: float) -> float | None:
    """The decode rate of reading a token's bytes of the GGUF file (decode_bytes) at
    `bandwidth_gbs` (None for a Hugging Face directory, whose weights the engines may hold in
    another dtype)."""
    if not model_path.endswith(".gguf"):
        return None
    return bandwidth_gbs * 1e9 / decode_bytes(model_path)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def _print_table(columns: list[tuple[str, int]], rows: dict[str, list[str]]) -> None:
    """An engine column, then right-aligned `columns` (name, width); one line per row."""
    label_width = max([16, *(len(label) + 1 for label in rows)])
    print(f"  {'engine':<{label_width}}" + "".join(f"{name:>{width}}" for name, width in columns))
    for label, cells in rows.items():
        print(f"  {label:<{label_width}}" + "".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, columns)))


def _print_throughputs(results: dict[str, Throughput], ratios: dict[str, tuple[Throughput, Throughput]]) -> None:
    """One row per result, then one per ratio (label: (numerator, denominator), > 1 is better)."""
    rows = {name: [f"{r.seconds:.2f}", f"{r.output_tok_s:.1f}", f"{r.total_tok_s:.1f}"] for name, r in results.items()}
    for label, (a, b) in ratios.items():
        rows[label] = ["", _ratio(a.output_tok_s, b.output_tok_s), _ratio(a.total_tok_s, b.total_tok_s)]
    _print_table([("time s", 9), ("output tok/s", 15), ("total tok/s", 14)], rows)


def print_throughput(results: dict[str, Throughput], workload: Workload) -> None:
    print(f"\nW1 throughput: {len(workload.prompts)} requests, {workload.prompt_tokens} prompt + "
          f"{workload.output_tokens} output tokens, temperature {workload.temperature}")
    (_, nano), *others = results.items()
    _print_throughputs(results, {f"vs {name}": (nano, other) for name, other in others})


def print_structured(plain: Throughput, structured: Throughput, workload: Workload) -> None:
    print(f"\nW1-JSON structured outputs: W1's {len(workload.prompts)} requests, each under one JSON schema "
          f"(an array of records)")
    _print_throughputs({"W1": plain, "W1-JSON": structured}, {"W1-JSON / W1": (structured, plain)})


def print_latency(results: dict[str, Latency], bound_tok_s: float | None = None, input_len: int = W2_INPUT_LEN,
                  output_len: int = W2_OUTPUT_LEN) -> None:
    """The W2 table; with `bound_tok_s`, each decode rate's share of it too."""
    print(f"\nW2 latency: 1 request, {input_len} prompt tokens, {output_len} greedy output tokens "
          f"(median of {W2_REPEATS})")
    columns = [("TTFT s", 9), ("prompt tok/s", 14), ("decode tok/s", 15)]
    rows = {name: [f"{r.ttft_s:.3f}", f"{r.prompt_tok_s:.1f}", f"{r.decode_tok_s:.1f}"] for name, r in results.items()}
    if bound_tok_s:
        columns.append(("of bound", 10))
        for name, r in results.items():
            rows[name].append(f"{r.decode_tok_s / bound_tok_s:.0%}")
    (_, nano), *others = results.items()
    for name, other in others:  # speed-ups: the other's TTFT over ours, our decode rate over theirs
        rows[f"vs {name}"] = [_ratio(other.ttft_s, nano.ttft_s), _ratio(nano.prompt_tok_s, other.prompt_tok_s),
                              _ratio(nano.decode_tok_s, other.decode_tok_s)]
    _print_table(columns, rows)
    if bound_tok_s:
        above = any(r.decode_tok_s > bound_tok_s for r in results.values())
        print(f"  bound: {bound_tok_s:.1f} tok/s, the read bandwidth over a token's bytes of the model file"
              + ("; above it, part of the file stays in the CPU's caches" if above else ""))


def plot_concurrency(runners: list, workload: Workload, path: str) -> None:
    """Output tok/s against the number of concurrent requests (the first n requests of W1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for runner in runners:
        rates = []
        for n in PLOT_CONCURRENCY:
            rates.append(run_throughput(runner, workload.head(n)).output_tok_s)
            print(f"  {runner.name:<14}{n:>3} concurrent: {rates[-1]:8.1f} output tok/s")
        ax.plot(PLOT_CONCURRENCY, rates, marker="o", label=f"{runner.name} ({runner.dtype})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(PLOT_CONCURRENCY, [str(n) for n in PLOT_CONCURRENCY])
    ax.set_xlabel("concurrent requests (the first n of W1)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(machine_summary(), fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="all", choices=["all", "w1", "w1-json", "w2", "copy"],
                        help="what to run (default: all, which is W1, W1-JSON and W2; w1-json runs W1 plain and "
                             "under a JSON schema; copy: speculative decoding on copy-heavy chats, and W2 with "
                             "and without it)")
    parser.add_argument("--compare", nargs="+", default=[], choices=["transformers", "llama.cpp", "ik_llama.cpp"],
                        help="also run the workloads with these engines (llama.cpp and ik_llama.cpp: a GGUF model "
                             "only, through llama-cpp-python and ik-llama-cpp-python)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="plot output tok/s against 1, 4, 16 and 64 concurrent requests")
    parser.add_argument("--twin", metavar="SHAPE:TYPE", type=parse_twin,
                        help="instead of --model, a random-weight twin of a real model, written once to the user "
                             "cache (TYPEs other than F16 quantized by llama-cpp-python); shapes: "
                             f"{', '.join(SHAPES)}; types: {', '.join(TYPES)}")
    parser.add_argument("--input-len", type=int, default=W2_INPUT_LEN, metavar="N",
                        help="W2's prompt tokens (default: %(default)s; 512 gives llama-bench's pp512)")
    parser.add_argument("--output-len", type=int, default=W2_OUTPUT_LEN, metavar="N",
                        help="W2's greedy output tokens (default: %(default)s)")
    parser.add_argument("--contention", action="store_true",
                        help="run the workloads beside a busy neighbour: llama.cpp decoding the same GGUF file "
                             "on as many threads, in another process (needs llama-cpp-python)")
    add_engine_arguments(parser)
    # Repeated prompts would hit the prefix cache and time the cache instead of the model.
    parser.set_defaults(enable_prefix_caching=False)


def main(args: argparse.Namespace) -> int:
    if args.input_len < 1 or args.output_len < 2:
        raise SystemExit(f"error: --input-len must be at least 1 and --output-len at least 2 (a decode rate needs "
                         f"a token after the first); got {args.input_len} and {args.output_len}")
    if args.twin:
        if args.model != DEFAULT_MODEL_ALIAS:
            raise SystemExit("error: --twin runs its own file instead of --model; give one of them")
        args.model = build_twin(args.twin)
    if args.contention:
        require_llama_cpp("--contention")  # before minutes of start-up, not after
    if args.workload == "copy":
        return main_copy(args)
    nano = NanoRunner(engine_kwargs(args))
    model_path = nano.llm.llm_engine.config.model_path
    if args.contention and not model_path.endswith(".gguf"):
        raise SystemExit(f"error: --contention runs llama.cpp on a GGUF file; {model_path} is not one")
    runners = [nano]
    if "transformers" in args.compare:
        runners.append(TransformersRunner(args.model, nano.llm.llm_engine.config.torch_dtype))
    with contextlib.ExitStack() as stack:
        for engine in ("llama.cpp", "ik_llama.cpp"):
            if engine in args.compare:
                runners.append(llama_cpp_runner(engine, model_path, args.input_len + args.output_len))
                stack.callback(runners[-1].close)
        bandwidth = read_bandwidth_gbs()  # before the neighbour starts: the machine's own figure
        print(f"{machine_summary()}, read bandwidth {bandwidth:.1f} GB/s")
        for runner in runners:
            compiled = f", of which compile {runner.compile_s:.1f} s" if runner.compile_s else ""
            own = (f", in its own process (OpenMP wait policy: {runner.openmp_wait_policy or 'its default'})"
                   if isinstance(runner, EngineProcess) else "")
            print(f"{runner.name}: {runner.dtype}, start-up {runner.startup_s:.1f} s{compiled}{own}")
        if args.contention:
            pid = stack.enter_context(busy_neighbour(model_path, torch.get_num_threads()))
            print(f"contention: llama.cpp decoding {os.path.basename(model_path)} on {torch.get_num_threads()} "
                  f"threads beside the engines (pid {pid})")
        run_workloads(args, runners, decode_bound_tok_s(model_path, bandwidth))
    return 0


def main_copy(args: argparse.Namespace) -> int:
    """The COPY workload: nano-vllm with speculation and without (and llama.cpp likewise)."""
    kwargs = engine_kwargs(args)
    speculation = kwargs["speculative_config"] or DEFAULT_SPECULATION
    nano = NanoRunner({**kwargs, "speculative_config": speculation})
    config = nano.llm.llm_engine.config
    nano.name = f"nano-vllm+{config.speculative_config.method}"
    plain = NanoRunner({**kwargs, "speculative_config": None})
    runners = [nano, plain]
    prompts = copy_prompts(nano.llm.get_tokenizer())
    longest = max(map(len, prompts)) + COPY_OUTPUT_LEN
    with contextlib.ExitStack() as stack:
        if "llama.cpp" in args.compare:
            if not config.model_path.endswith(".gguf"):
                raise SystemExit(f"error: --compare llama.cpp runs GGUF files; {config.model_path} is not one")
            spec = config.speculative_config
            lookup_tokens = spec.num_speculative_tokens if spec.method == "ngram" else LOOKUP_DEFAULT_TOKENS
            for engine in ("llama.cpp+lookup", "llama.cpp"):
                runners.append(EngineProcess(engine, config.model_path, torch.get_num_threads(), 1,
                                             -(-longest // 256) * 256, lookup_tokens))
                stack.callback(runners[-1].close)
        print(machine_summary())
        for runner in runners:
            print(f"{runner.name}: {runner.dtype}, start-up {runner.startup_s:.1f} s")
        if args.contention:
            pid = stack.enter_context(busy_neighbour(config.model_path, torch.get_num_threads()))
            print(f"contention: llama.cpp decoding {os.path.basename(config.model_path)} on "
                  f"{torch.get_num_threads()} threads beside the engines (pid {pid})")
        before = nano.llm.get_metrics()
        rates = run_copy(runners, prompts, COPY_OUTPUT_LEN)
        after = nano.llm.get_metrics()
        drafts, drafted, accepted = (after[key] - before[key] for key in (
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
        acceptance = (f"{nano.name}: {accepted} of {drafted} drafted tokens accepted "
                      f"({accepted / max(drafted, 1):.0%}), {1 + accepted / max(drafts, 1):.2f} tokens a verifying step")
        print_copy(rates, len(prompts), acceptance, COPY_OUTPUT_LEN)
        print_latency(run_latencies([nano, plain], args.input_len, args.output_len), None, args.input_len,
                      args.output_len)
    return 0


def run_workloads(args: argparse.Namespace, runners: list, bound_tok_s: float | None) -> None:
    nano = runners[0]
    workload = throughput_workload()
    if args.workload in ("all", "w1"):
        w1 = {r.name: run_throughput(r, workload) for r in runners}
        print_throughput(w1, workload)
    if args.workload in ("all", "w1-json"):
        plain = w1[nano.name] if args.workload == "all" else run_throughput(nano, workload)
        structured = dataclasses.replace(workload, schema=STRUCTURED_SCHEMA)
        print_structured(plain, run_throughput(nano, structured), structured)
    if args.workload in ("all", "w2"):
        print_latency(run_latencies(runners, args.input_len, args.output_len), bound_tok_s,
                      args.input_len, args.output_len)
    if args.plot:
        print("\nconcurrency sweep")
        plot_concurrency(runners, workload, args.plot)
