"""Tensor parallelism across processes (gloo on CPU): tp=2 against tp=1 end to end, the
step's wire format, ranks started torchrun-style, and faults (a killed worker, Ctrl-C,
a dead rank 0, start-up errors) ending in a clear error and no leftover processes.

Every spawned rank imports torch (seconds), so each test starts as few engines as it can.
A test that could hang is bounded by faulthandler, which also fires while the main thread
is blocked inside a collective, where Python signal handlers cannot run.
"""

import faulthandler
import gc
import json
import os
import pickle
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import family_config, make_tiny_checkpoint
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine.step_messages import StepReceiver, StepSender
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", kvcache_block_size=16, num_kvcache_blocks=250, max_num_batched_tokens=4096)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@contextmanager
def hang_guard(seconds: float):
    """Dump every thread's stack and exit the test process if the block outlives `seconds`."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextmanager
def one_thread():
    """Run a tp=1 reference as the tp=2 ranks run (one thread each on a 2-core machine):
    many threads on a busy machine make every small op wait on its slowest thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def workload_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(300) for _ in range(64)]  # 4 full blocks shared by every prompt
    return [prefix + [rng.randrange(300) for _ in range(136)] for _ in range(30)]


def run_workload(llm: LLM) -> list:
    """One prompt alone (publishing the shared prefix), then 29 at once: a ~4000-token first
    step, prefix-cache hits, and more blocks than the pool has (preemption). The last two
    requests sample with a seed and ask for prompt logprobs (recomputed after preemption); the
    one before them is held to a regex (rank 0's mask) and biased."""
    prompts = workload_prompts()
    constrained = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={5: 3.0},
                                 structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,80}"))
    params = [GREEDY] * 26 + [constrained,
        SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=2, logprobs=2),
    ]
    outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    assert re.fullmatch("[a-z ]{1,80}", outs[-3].outputs[0].text)
    tokens = [o.outputs[0].token_ids for o in outs]
    top_prompt_tokens = [sorted(position) for position in outs[-1].prompt_logprobs[1:]]
    return [tokens, top_prompt_tokens]


TARGET_AS_DRAFT = "<the target's checkpoint>"
TP_CASES = {
    # One KV head, replicated on both ranks; head_dim != hidden / heads.
    "qwen3-replicated-kv": ("Qwen3ForCausalLM", dict(head_dim=32, num_key_value_heads=1)),
    # q/k/v biases (added once, on rank 0) and an odd vocabulary (a padded shard).
    "qwen2-padded-vocab": ("Qwen2ForCausalLM", dict(vocab_size=321)),
    # Weights quantized at load to Q8_0 blocks: column shards cut rows of blocks, row-parallel
    # shards whole blocks of each row (32 of the 64 inputs of o_proj a rank).
    "llama-q8_0-blocks": ("LlamaForCausalLM", dict(quantization="q8_0")),
    # Softcaps, sandwich norms, tanh GELU and a sliding window on layer 0 (prompts pass it).
    "gemma2-window": family_config("gemma2", 12),
    # q/k/v and gate/up packed in the checkpoint: each rank cuts its rows of each projection.
    "phi3-packed": ("Phi3ForCausalLM", {}),
    # Local and global layers, each with its own RoPE.
    "gemma3-window": family_config("gemma3", 12),
    # Experts' intermediate dims sharded, a shared expert's partial sum added before the one
    # all-reduce.
    "qwen2-moe-shared-expert": family_config("qwen2-moe", None),
    # Experts quantized at load to Q8_0, run by the CPU's MoE kernel on each rank (one block of
    # each expert's down row a rank). Top-1: with more experts a token, the all-reduce adds each
    # rank's weighted sum of its experts' partial rows, an order of fp32 additions of its own,
    # which can turn a near-tie here.
    "qwen3-moe-q8_0-experts": family_config("qwen3-moe", None, moe_intermediate_size=64, num_experts_per_tok=1,
                                            quantization="q8_0"),
    # Speculative decoding: the drafts travel in the step's batch, so every rank runs their rows.
    "qwen3-ngram-drafts": ("Qwen3ForCausalLM", dict(speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64})),
    # A draft model (the target's own checkpoint) runs unsharded on rank 0; its drafts travel alike.
    "qwen3-draft-model": ("Qwen3ForCausalLM", dict(speculative_config={
        "model": TARGET_AS_DRAFT, "num_speculative_tokens": 3, "disable_by_batch_size": 64})),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp2_matches_tp1_with_prefix_caching_and_preemption(case, tmp_path):
    arch, overrides = TP_CASES[case][0], dict(TP_CASES[case][1])
    engine = dict(ENGINE, quantization=overrides.pop("quantization", None),
                  speculative_config=overrides.pop("speculative_config", None))
    path = str(make_tiny_checkpoint(tmp_path, arch, **overrides))
    if engine["speculative_config"] is not None and engine["speculative_config"].get("model") == TARGET_AS_DRAFT:
        engine["speculative_config"] = {**engine["speculative_config"], "model": path}
    reference = LLM(path, **engine)
    with one_thread():
        expected = run_workload(reference)
    with hang_guard(180):
        llm = LLM(path, tensor_parallel_size=2, **engine)
        workers = llm.llm_engine.executor.workers.procs
        assert run_workload(llm) == expected
        metrics = llm.get_metrics()
        assert metrics == reference.get_metrics()  # the same schedule, step for step
        assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] > 0
        if engine["speculative_config"] is not None:
            assert metrics["spec_decode_num_accepted_tokens"] > 0
        del llm
        gc.collect()  # dropping the LLM stops its workers and leaves the process group
    assert not any(p.is_alive() for p in workers) and not dist.is_initialized()


def test_step_messages_carry_new_tokens_only_and_resend_returning_sequences():
    def fields(seq) -> tuple:
        return (seq.token_ids, seq.num_tokens, seq.num_prompt_tokens, seq.num_computed_tokens, seq.block_table,
                seq.wants_prompt_logprobs)

    sender, receiver = StepSender(), StepReceiver()

    def step(seqs: list[Sequence], num_new: list[int]):
        batch = ScheduledBatch(seqs, num_new)
        message = pickle.loads(pickle.dumps(sender.encode(batch)))
        copy = receiver.decode(message)
        assert [fields(s) for s in copy.seqs] == [fields(s) for s in seqs]
        assert copy.num_new_tokens == num_new
        assert [copy.samples(i) for i in range(len(seqs))] == [batch.samples(i) for i in range(len(seqs))]
        return message

    a = Sequence(list(range(40)), SamplingParams())
    b = Sequence(list(range(100, 105)), SamplingParams(prompt_logprobs=1))
    a.block_table, b.block_table = [3, 4, 5], [7]
    step([a, b], [32, 5])  # a's prompt is chunked; b's finishes and samples
    a.num_computed_tokens, b.num_computed_tokens = 32, 5
    b.token_ids.append(9)
    message = step([a, b], [8, 1])
    assert [(u.start, u.new_token_ids) for u in message.updates] == [(40, []), (5, [9])]
    a.num_computed_tokens, b.num_computed_tokens = 40, 6
    a.token_ids.append(11)
    step([a], [1])  # b left the batch (preempted): both sides forget it
    b.reset_for_recompute()
    b.block_table = [8]
    message = step([a, b], [1, 6])
    assert [(u.start, len(u.new_token_ids)) for u in message.updates] == [(41, 0), (0, 6)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    # One thread per rank: the ranks share this machine's cores.
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


RANK0_SCRIPT = """
import json, sys
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
llm = LLM(sys.argv[1], dtype="float32", num_kvcache_blocks=64, tensor_parallel_size=2)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


@pytest.mark.parametrize("launcher", [["-m", "nanovllm.distributed"], []], ids=["launcher", "plain-script"])
def test_ranks_started_torchrun_style_as_separate_processes(launcher, tmp_path):
    path = str(make_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM"))
    prompts = [p[:50] for p in workload_prompts(seed=1)[:4]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with one_thread():
        expected = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)]
    script = tmp_path / "generate.py"
    script.write_text(RANK0_SCRIPT)
    env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    # The worker starts first and waits for rank 0's store; rank 0 runs the script through
    # the same entry point, as torchrun would launch it, or as a plain `python script.py`.
    worker = subprocess.Popen([sys.executable, "-m", "nanovllm.distributed"], env={**env, "RANK": "1"},
                              stderr=subprocess.PIPE, text=True)
    rank0 = subprocess.Popen([sys.executable, *launcher, str(script), path,
                              json.dumps(prompts)], env={**env, "RANK": "0"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = rank0.communicate(timeout=120)
        assert rank0.returncode == 0, err
        assert json.loads(out) == expected
        _, err = worker.communicate(timeout=30)  # rank 0's exit stops it
        assert worker.returncode == 0, err
    finally:
        for proc in (rank0, worker):
            proc.kill()


def test_killed_worker_raises_a_clear_error(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM"))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with hang_guard(120):
        llm = LLM(path, tensor_parallel_size=2, dtype="float32", num_kvcache_blocks=64)
        worker = llm.llm_engine.executor.workers.procs[0]
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
            while True:  # the kill lands mid-step or between steps; both must be caught
                llm.generate([[1, 2, 3]] * 4, params, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="stopped after an error"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert not dist.is_initialized()


def test_start_up_error_names_the_dimension_and_leaves_nothing_behind(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", hidden_size=96, num_attention_heads=3,
                                    num_key_value_heads=1))
    with hang_guard(120), pytest.raises(ValueError, match="num_attention_heads=3"):
        LLM(path, tensor_parallel_size=2, dtype="float32", num_kvcache_blocks=32)
    assert not mp.active_children() and not dist.is_initialized()


INTERRUPTED_SCRIPT = """
import sys
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", num_kvcache_blocks=64, tensor_parallel_size=2)
    print(llm.llm_engine.executor.workers.procs[0].pid, flush=True)
    while True:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
"""


def pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["ctrl-c", "rank0-killed"])
def test_no_worker_outlives_rank_0(how, tmp_path):
    path = str(make_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM"))
    script = tmp_path / "loop.py"
    script.write_text(INTERRUPTED_SCRIPT)
    # A session of its own, so a Ctrl-C can reach its whole process group as a terminal's would.
    rank0 = subprocess.Popen([sys.executable, str(script), path], env=subprocess_env(), start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with hang_guard(120):
            worker_pid = int(rank0.stdout.readline())
        time.sleep(1)  # well into the generate loop
        if how == "ctrl-c":
            os.killpg(rank0.pid, signal.SIGINT)
            _, err = rank0.communicate(timeout=30)
            assert "KeyboardInterrupt" in err
        else:
            rank0.kill()
            rank0.wait(timeout=30)
        deadline = time.monotonic() + 10
        while pid_running(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_running(worker_pid)
    finally:
        rank0.kill()
