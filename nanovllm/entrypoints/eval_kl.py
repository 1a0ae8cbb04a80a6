"""`nanovllm eval-kl`: how far a configuration's next-token distributions are from a reference's,
measured as llama.cpp measures quantization (its perplexity tool's KL-divergence mode).

A fixed text (eval_text.txt beside this module by default: ~3,200 tokens of mixed prose, dialogue,
a recipe and code, written for this purpose) is cut into
windows of `--window` tokens; each window is a prompt to both engines, and the second half of each
window's positions is scored, so every scored token has at least half a window of context. The
configuration under test takes its prompts `--step-tokens` (8) at a time, as chunks of a decode-
sized step, so its few-row kernels are what is measured (the quantized ones give every step
size the same bits). The
reference is the same checkpoint with every weight dequantized (`quantization="dense"`) in fp32,
eager; the configuration under test is the one the engine flags describe (by default: the
checkpoint's own quantized types, the default dtype). Reported: both perplexities, the mean,
median, 99th percentile and largest KL divergence KL(reference || test), and how often both
engines' most likely next token agree. With `--compare llama.cpp` (a GGUF file), llama.cpp runs the
same file on the same windows (llama-cpp-python, every position's logits) and is scored against
the same reference beside us: the quality floor of a quantized type is llama.cpp's own figure.
"""

import argparse
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.entrypoints.engine_args import add_engine_arguments, engine_kwargs

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "eval_text.txt")


@dataclass
class Divergence:
    tokens: int
    perplexity_reference: float
    perplexity: float
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float

    def lines(self) -> list[str]:
        return [
            f"scored tokens:          {self.tokens}",
            f"perplexity (reference): {self.perplexity_reference:.4f}",
            f"perplexity:             {self.perplexity:.4f} ({self.perplexity / self.perplexity_reference - 1:+.2%})",
            f"mean KL divergence:     {self.mean_kl:.6f}",
            f"median / 99% / max KL:  {self.median_kl:.6f} / {self.p99_kl:.6f} / {self.max_kl:.6f}",
            f"top-1 agreement:        {self.top1_agreement:.2%}",
        ]


def prompt_logits(llm, prompt: list[int]) -> torch.Tensor:
    """log-softmax of the logits predicting prompt tokens 1..n-1 from their prefixes, [n-1, vocab] fp32.

    The engine computes them for prompt logprobs; this reads them off the model's `compute_logits`
    (a single-process engine: tensor-parallel ranks live in other processes)."""
    from nanovllm import SamplingParams

    model = llm.llm_engine.executor.model
    captured, compute = [], model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        captured.append(logits)
        return logits

    model.compute_logits = capture
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    finally:
        del model.compute_logits
    rows = torch.cat(captured)[: len(prompt) - 1]
    return torch.log_softmax(rows, dim=-1)


def compare(reference: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position: each side's negative log-likelihood of the target, KL(ref || test), top-1 agreement."""
    kl = (reference.exp() * (reference - test)).sum(-1).clamp_min(0)
    return {
        "nll_reference": -reference.gather(1, targets[:, None])[:, 0],
        "nll": -test.gather(1, targets[:, None])[:, 0],
        "kl": kl,
        "agree": (reference.argmax(-1) == test.argmax(-1)).float(),
    }


# prompt -> log-softmax rows [len(prompt) - 1, vocab], as prompt_logits gives them
Logits = Callable[[list[int]], torch.Tensor]


def llama_cpp_logits(model_path: str, threads: int, window: int) -> Logits:
    """prompt_logits's counterpart for llama.cpp running the GGUF file at model_path."""
    from nanovllm.entrypoints.bench_llama_cpp import import_llama_cpp

    llama_cpp = import_llama_cpp("--compare llama.cpp")
    llm = llama_cpp.Llama(model_path, n_ctx=window, n_batch=window, logits_all=True, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def logits(prompt: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(prompt)
        rows = torch.from_numpy(np.asarray(llm.scores[: len(prompt) - 1], dtype=np.float32))
        return torch.log_softmax(rows, dim=-1)
    return logits



def evaluate(reference: Logits, tests: dict[str, Logits], tokens: list[int], window: int) -> dict[str, Divergence]:
    """Each of `tests` (by name) against `reference`, on the same windows."""
    parts = {name: [] for name in tests}
    for start in range(0, len(tokens) - window + 1, window):
        prompt = tokens[start:start + window]
        scored = slice(window // 2 - 1, window - 1)  # predictions of tokens window/2 .. window-1
        targets = torch.tensor(prompt[1:])[scored]
        expected = reference(prompt)[scored]
        for name, test in tests.items():
            parts[name].append(compare(expected, test(prompt)[scored], targets))
    if not next(iter(parts.values())):
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one window of {window}")
    return {name: _divergence(each) for name, each in parts.items()}


def _divergence(parts: list[dict[str, torch.Tensor]]) -> Divergence:
    stats = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    kl = stats["kl"]
    return Divergence(
        tokens=kl.numel(),
        perplexity_reference=math.exp(stats["nll_reference"].mean().item()),
        perplexity=math.exp(stats["nll"].mean().item()),
        mean_kl=kl.mean().item(),
        median_kl=kl.median().item(),
        p99_kl=kl.quantile(0.99).item(),
        max_kl=kl.max().item(),
        top1_agreement=stats["agree"].mean().item(),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", default=DEFAULT_TEXT, metavar="FILE",
                        help="the text to score (default: the ~3,200-token text shipped beside this module)")
    parser.add_argument("--window", type=int, default=512, metavar="N",
                        help="tokens a window; the second half of each is scored (default: %(default)s)")
    parser.add_argument("--step-tokens", type=int, default=8, metavar="N",
                        help="prompt tokens a step for the configuration under test, so that the kernels of "
                             "decode-sized steps are what is measured (default: %(default)s; the reference "
                             "takes whole windows)")
    parser.add_argument("--compare", choices=["llama.cpp"], nargs="+", default=[],
                        help="also score llama.cpp on the same GGUF file and windows against the same reference "
                             "(needs llama-cpp-python)")
    add_engine_arguments(parser)
    parser.set_defaults(enable_prefix_caching=False)


def main(args: argparse.Namespace) -> int:
    from nanovllm import LLM

    if args.window < 4:
        raise SystemExit(f"error: --window must be at least 4, got {args.window}")
    kwargs = engine_kwargs(args)
    if kwargs.get("tensor_parallel_size", 1) != 1:
        raise SystemExit("error: eval-kl reads the logits in this process: run it without tensor parallelism")
    kwargs["max_model_len"] = max(kwargs.get("max_model_len") or 0, args.window + 1)
    with open(args.text) as f:
        text = f.read()
    llm = LLM(**dict(kwargs, max_num_batched_tokens=args.step_tokens))
    config = llm.llm_engine.config
    if args.compare and not config.model_path.endswith(".gguf"):
        raise ValueError(f"--compare llama.cpp runs a GGUF file; {config.model_path} is not one")
    reference_kwargs = dict(kwargs, dtype="float32", quantization="dense", enforce_eager=True,
                            max_num_batched_tokens=max(args.window, kwargs.get("max_num_batched_tokens") or 0))
    reference = LLM(**reference_kwargs)
    tokens = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
    print(f"{config.model_path}: {config.dtype}, quantization {config.quantization or 'the checkpoint own'}, "
          f"{args.step_tokens} tokens a step, against dense float32; {len(tokens)} tokens, windows of {args.window}")
    tests = {"nano-vllm": functools.partial(prompt_logits, llm)}
    if args.compare:
        tests["llama.cpp"] = llama_cpp_logits(config.model_path, config.num_threads, args.window)
    results = evaluate(functools.partial(prompt_logits, reference), tests, tokens, args.window)
    for name, divergence in results.items():
        if len(results) > 1:
            print(f"{name}:")
        print("\n".join(divergence.lines()))
    return 0
