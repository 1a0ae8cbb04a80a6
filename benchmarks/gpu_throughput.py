"""Offline throughput on a GPU: a Qwen3-0.6B-shaped model with random weights, 256 requests
with random-id prompts of 100-1024 tokens and 100-1024 output tokens each (EOS ignored,
temperature 0.6), all submitted at once; prints output tokens per second. With
`--decode-latency`, instead: the time of one decode step at batch 1 and 64 (128-token
prompts, greedy), against the weight-bandwidth bound (the weights' bytes over the memory
bandwidth, 4.8 TB/s for an H200: every step reads every weight once).

The checkpoint (config, random bf16 safetensors, a word-level tokenizer over the whole
vocabulary) is written to --checkpoint on first use and reused after. One engine per
process: run once with and once without --enforce-eager to compare CUDA graphs with eager.
`--tiny` shrinks model and workload so the script can be checked on a CPU.

    python benchmarks/gpu_throughput.py --checkpoint /tmp/qwen3-0.6b-random [--enforce-eager]
"""

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Qwen3-0.6B's shape (its config.json), with random weights.
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
H200_BANDWIDTH = 4.8e12  # bytes/s
DECODE_BATCHES = (1, 64)
DECODE_PROMPT_LEN = DECODE_STEPS = 128
TINY = dict(QWEN3_0_6B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def build_checkpoint(path: str, shape: dict, device: str) -> None:
    """Write a random-weight Qwen3 checkpoint and a tokenizer with one word per token id."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = shape["vocab_size"]
    config = transformers.Qwen3Config(**shape, eos_token_id=vocab_size - 1, bos_token_id=None,
                                      architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # random init on the GPU takes seconds, not minutes
            model = transformers.Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{vocab_size - 1}").save_pretrained(path)


def workload(num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(min(vocab_size, 10000)) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, output_lens


def decode_latency(llm, runner, device: str, vocab_size: int, bandwidth: float, batches=DECODE_BATCHES,
                   prompt_len: int = DECODE_PROMPT_LEN, num_steps: int = DECODE_STEPS) -> dict:
    """Per batch size: the mean decode step of `num_steps` greedy steps after a `prompt_len`
    prefill (a full run less a prefill-only run), and its ratio to the bound."""
    from nanovllm import SamplingParams

    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    bound = weight_bytes / bandwidth
    rng = random.Random(1)
    steps = {}
    for batch in batches:
        prompts = [[rng.randrange(min(vocab_size, 10000)) for _ in range(prompt_len)] for _ in range(batch)]

        def run(max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        run(2)  # warm-up at this batch size
        prefill = min(run(1) for _ in range(3))
        full = min(run(num_steps + 1) for _ in range(2))
        steps[batch] = (full - prefill) / num_steps
        print(f"decode step at batch {batch:3d}: {1e3 * steps[batch]:.3f} ms = {steps[batch] / bound:.2f}x the "
              f"weight-bandwidth bound ({1e3 * bound:.3f} ms: {weight_bytes / 1e9:.2f} GB at "
              f"{bandwidth / 1e12:.1f} TB/s)")
    return dict(kind="decode_latency", weight_bytes=weight_bytes, bound_ms=round(1e3 * bound, 4),
                step_ms={str(b): round(1e3 * t, 4) for b, t in steps.items()},
                over_bound={str(b): round(t / bound, 2) for b, t in steps.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="directory of the random checkpoint (made if missing)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--tiny", action="store_true", help="tiny model and workload, for a CPU dry run")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--min-len", type=int, help="shortest prompt and output (tokens)")
    parser.add_argument("--max-len", type=int, help="longest prompt and output (tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="append the result as one JSON line to this file")
    parser.add_argument("--decode-latency", action="store_true",
                        help="time decode steps at batch 1 and 64 instead of the throughput workload")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="memory bytes/s for the bound")
    args = parser.parse_args()
    shape = TINY if args.tiny else QWEN3_0_6B
    num_requests = args.num_requests or (8 if args.tiny else 256)
    min_len = args.min_len or (10 if args.tiny else 100)
    max_len = args.max_len or (40 if args.tiny else 1024)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    from nanovllm import LLM, SamplingParams

    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        start = time.perf_counter()
        build_checkpoint(args.checkpoint, shape, device)
        print(f"built a random checkpoint in {args.checkpoint} ({time.perf_counter() - start:.1f} s)")

    start = time.perf_counter()
    llm = LLM(args.checkpoint, device=device, max_model_len=2 * max_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False, seed=args.seed)
    startup = time.perf_counter() - start
    runner = llm.llm_engine.executor
    graphs = runner.cuda_graphs is not None
    print(f"engine ready in {startup:.1f} s: {llm.llm_engine.config.dtype}, {type(runner.backend).__name__}, "
          f"{runner.num_kvcache_blocks} KV blocks, CUDA graphs {'on' if graphs else 'off'}")

    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    common = dict(model="tiny" if args.tiny else "Qwen3-0.6B-shaped (random weights)", device=device,
                  gpu=torch.cuda.get_device_name() if device == "cuda" else None, cuda_graphs=graphs)
    if args.decode_latency:
        sizes = dict(batches=(1, 8), prompt_len=16, num_steps=16) if args.tiny else {}
        report(dict(common, **decode_latency(llm, runner, device, shape["vocab_size"], args.bandwidth, **sizes)),
               args.json_out)
        return
    prompts, output_lens = workload(num_requests, min_len, max_len, shape["vocab_size"], args.seed)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in output_lens]
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert output_tokens == sum(output_lens), "ignore_eos: every request must produce exactly max_tokens"
    result = dict(common, kind="throughput", requests=num_requests, prompt_tokens=sum(map(len, prompts)),
                  output_tokens=output_tokens, seconds=round(elapsed, 2),
                  output_tokens_per_s=round(output_tokens / elapsed, 1),
                  total_tokens_per_s=round((output_tokens + sum(map(len, prompts))) / elapsed, 1),
                  startup_s=round(startup, 1), metrics=llm.get_metrics())
    print(f"CUDA graphs {'on ' if graphs else 'off'}: {output_tokens} output tokens in {elapsed:.2f} s = "
          f"{result['output_tokens_per_s']:.0f} output tok/s ({result['total_tokens_per_s']:.0f} tok/s with prompts)")
    report(result, args.json_out)


def report(result: dict, json_out: str | None) -> None:
    """Print the result as one JSON line, and append it to `json_out` when given."""
    print(json.dumps(result))
    if json_out:
        with open(json_out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
