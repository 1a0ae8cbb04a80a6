#!/usr/bin/env bash
# GPU acceptance check (issues #8, #18), for one NVIDIA GPU with a CUDA build of torch installed;
# at most 420 s on an H200 (the section limits add up to less, so a rerun fits in a 15-minute
# window). Run from anywhere: bash scripts/gpu_check.sh
#   1. Triton kernels against the portable backend on random paged inputs (fp32 and bf16,
#      head dims 64 and 128).
#   2. Parity on CUDA: greedy tokens identical to transformers on the same device in fp32,
#      bf16 log-probabilities close; CUDA-graph replay = eager; memory-based KV sizing.
#   3. Throughput: Qwen3-0.6B-shaped model, random weights, 256 requests, prompts and outputs
#      of 100-1024 tokens, ignore_eos; with and without CUDA graphs; output tokens/s.
#   4. Decode-step latency at batch 1 and 64 against the weight-bandwidth bound.
# Each section has a time limit and its own status, prints as it finishes, and the figures
# print whatever the tests say. The log also goes to $OUT/gpu_check.log when $OUT is set.
# Packages the GPU machine lacks and cannot download (it reaches no registry) are installed
# from ./wheels when it holds them: `pip download --no-deps -d wheels gguf llguidance` on a
# machine that can (git-ignored; carry it with the run).
# `--cpu-dry-run` checks the script itself without a GPU: tests are only collected, and the
# benchmark runs a tiny model on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG="${OUT:-/tmp}/gpu_check.log"
RESULTS="$WORK/results.jsonl"
CHECKPOINT="${NANOVLLM_BENCH_CHECKPOINT:-/tmp/nanovllm-qwen3-0.6b-random}"
PYTEST=(python -m pytest -q -p no:cacheprovider)
BENCH=(python benchmarks/gpu_throughput.py --checkpoint "$CHECKPOINT" --json-out "$RESULTS")
if [ "${1:-}" = "--cpu-dry-run" ]; then
    PYTEST+=(--collect-only)
    CHECKPOINT="$WORK/tiny-checkpoint"
    BENCH=(python benchmarks/gpu_throughput.py --checkpoint "$CHECKPOINT" --json-out "$RESULTS" --tiny --device cpu)
fi
exec > >(tee "$LOG") 2>&1
status=0
started=$SECONDS

section() { echo; echo "=== $1  (t+$((SECONDS - started)) s)"; }
run() {  # run LIMIT_S CMD...: a failure or timeout marks the check failed, and the script goes on
    local limit=$1; shift
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "!!! FAILED (exit $rc$([ $rc -eq 124 ] && echo ", timed out after $limit s")): $*"
        status=1
    fi
}

section "environment"
if [ "${1:-}" != "--cpu-dry-run" ]; then
    python -c "import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'" || exit 1
fi
missing=$(python - <<'PY'
import importlib.util
needed = {"transformers": "transformers", "safetensors": "safetensors", "xxhash": "xxhash",
          "tokenizers": "tokenizers", "numpy": "numpy", "tqdm": "tqdm", "pytest": "pytest", "triton": "triton"}
print(" ".join(pkg for module, pkg in needed.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    echo "!!! missing: $missing (the engine and the tests need them)"
    exit 1
fi
if ls wheels/*.whl >/dev/null 2>&1; then  # optional packages (gguf, llguidance), offline
    pip install -q --no-index --no-deps wheels/*.whl || echo "!!! could not install the wheels in ./wheels"
fi
python - <<'PY'
import torch, triton, transformers
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (dry run)"
print(f"{device}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}")
try:
    import flash_attn
    print(f"flash-attn {flash_attn.__version__} (used only with kvcache_block_size % 256 == 0)")
except ImportError:
    print("flash-attn not installed: the Triton backend serves attention")
PY

section "1/4 Triton kernels vs the portable backend (compiled, fp32 + bf16, head dims 64/128)"
run 70 "${PYTEST[@]}" tests/test_triton_kernels.py

section "2/4 parity on CUDA: transformers fp32 tokens, bf16 closeness, CUDA graphs, KV sizing"
run 110 env NANOVLLM_TEST_DEVICE=cuda "${PYTEST[@]}" tests/test_engine.py tests/test_cuda_graph.py \
    tests/test_gpu_memory.py

section "3/4 throughput, Qwen3-0.6B shape, 256 requests: with CUDA graphs, then eager"
run 70 "${BENCH[@]}"
run 90 "${BENCH[@]}" --enforce-eager

section "4/4 decode step at batch 1 and 64 against the weight-bandwidth bound (CUDA graphs)"
run 35 "${BENCH[@]}" --decode-latency

section "summary"
python - "$RESULTS" <<'PY'
import json, os, sys
results = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for r in results:
    if r["kind"] == "decode_latency":
        steps = ", ".join(f"batch {b}: {ms} ms ({r['over_bound'][b]}x)" for b, ms in r["step_ms"].items())
        print(f"{r['gpu'] or r['device']}: decode step {steps}; bound {r['bound_ms']} ms")
        continue
    print(f"{r['gpu'] or r['device']}: CUDA graphs {'on ' if r['cuda_graphs'] else 'off'} "
          f"{r['output_tokens_per_s']:>9.1f} output tok/s ({r['output_tokens']} output + {r['prompt_tokens']} "
          f"prompt tokens in {r['seconds']} s; {r['metrics']['num_kvcache_blocks']} KV blocks, "
          f"{r['metrics']['num_preemptions']} preemptions)")
by_mode = {r["cuda_graphs"]: r["output_tokens_per_s"] for r in results if r["kind"] == "throughput"}
if len(by_mode) == 2:
    print(f"CUDA graphs speed-up: {by_mode[True] / by_mode[False]:.2f}x")
PY
echo "total $((SECONDS - started)) s: $([ $status -eq 0 ] && echo "ALL CHECKS PASSED" || echo "SOME CHECKS FAILED")"
exit $status
