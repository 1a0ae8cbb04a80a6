#!/usr/bin/env bash
# GPU acceptance check (issue #8), for one NVIDIA GPU with a CUDA build of torch installed;
# under 8 minutes on an H200. Run from anywhere: bash scripts/gpu_check.sh
#   1. Triton kernels against the portable backend on random paged inputs (fp32 and bf16).
#   2. Parity on CUDA: greedy tokens identical to transformers on the same device in fp32,
#      bf16 log-probabilities close; CUDA-graph replay = eager; memory-based KV sizing.
#   3. Throughput: Qwen3-0.6B-shaped model, random weights, 256 requests, prompts and outputs
#      of 100-1024 tokens, ignore_eos; with and without CUDA graphs; output tokens/s.
# Each section has a time limit and its own status, and the figures print whatever the tests
# say. The log also goes to $OUT/gpu_check.log when $OUT is set.
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
    timeout --kill-after=10 "$limit" "$@"
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
needed = {"transformers": "transformers", "safetensors": "safetensors", "xxhash": "xxhash", "gguf": "gguf",
          "tokenizers": "tokenizers", "numpy": "numpy", "tqdm": "tqdm", "pytest": "pytest", "triton": "triton"}
print(" ".join(pkg for module, pkg in needed.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    echo "installing: $missing"
    pip install -q $missing || { echo "!!! could not install: $missing"; exit 1; }
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

section "1/3 Triton kernels vs the portable backend (compiled, fp32 + bf16, block sizes 16/32/256)"
run 150 "${PYTEST[@]}" tests/test_triton_kernels.py

section "2/3 parity on CUDA: transformers fp32 tokens, bf16 closeness, CUDA graphs, KV sizing"
run 240 env NANOVLLM_TEST_DEVICE=cuda "${PYTEST[@]}" tests/test_engine.py tests/test_cuda_graph.py \
    tests/test_gpu_memory.py

section "3/3 throughput, Qwen3-0.6B shape, 256 requests: with CUDA graphs, then eager"
run 150 "${BENCH[@]}"
run 150 "${BENCH[@]}" --enforce-eager

section "summary"
python - "$RESULTS" <<'PY'
import json, os, sys
results = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for r in results:
    print(f"{r['gpu'] or r['device']}: CUDA graphs {'on ' if r['cuda_graphs'] else 'off'} "
          f"{r['output_tokens_per_s']:>9.1f} output tok/s ({r['output_tokens']} output + {r['prompt_tokens']} "
          f"prompt tokens in {r['seconds']} s; {r['metrics']['num_kvcache_blocks']} KV blocks, "
          f"{r['metrics']['num_preemptions']} preemptions)")
by_mode = {r["cuda_graphs"]: r["output_tokens_per_s"] for r in results}
if len(by_mode) == 2:
    print(f"CUDA graphs speed-up: {by_mode[True] / by_mode[False]:.2f}x")
PY
echo "total $((SECONDS - started)) s: $([ $status -eq 0 ] && echo "ALL CHECKS PASSED" || echo "SOME CHECKS FAILED")"
exit $status
