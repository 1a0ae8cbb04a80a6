"""llama.cpp as a comparison engine for `nanovllm bench --compare llama.cpp`, through
llama-cpp-python's low-level API (an optional extra: `pip install llama-cpp-python`, which pip
builds from source).

The GGUF file the engine runs is loaded as it is, with the same thread count. Every request of a
workload shares one context, a sequence id a request, each with its own part of the KV cache (a
unified cache runs W1 slower, figures in benchmarks/RESULTS.md: each token's attention then spans
every request's cells), and each `llama_decode` takes a batch of up to 2,048 tokens (our default step budget):
every running request's next token first, then prompt chunks, logits only where a token is
sampled. Tokens are sampled by llama.cpp's own sampler chain (temperature then a seeded draw, or
greedy), so no numpy runs over the vocabulary. This is how llama.cpp's own batched server and
`llama-batched-bench` drive it; the high-level `Llama` object runs one sequence at a time.

`LlamaCppLookupRunner` is llama.cpp with its own n-gram speculation, as llama-cpp-python offers it
(the high-level `Llama` with a `LlamaPromptLookupDecoding` draft model), one request at a time:
the comparison of the copy workload's speculative decoding.

The bench runs these runners in a process of its own (bench_engine_process). `--contention` runs a
busy neighbour beside the measured engines: another such process, llama.cpp's high-level `Llama`
on the same file and thread count, decoding without pause (`python -m
nanovllm.entrypoints.bench_llama_cpp FILE THREADS` is that process).
"""

import contextlib
import ctypes
import importlib.util
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator

STEP_TOKENS = 2048
NEIGHBOUR_PROMPT = list(range(1, 33))
NEIGHBOUR_TOKENS = 128  # a round's output; then the prompt again, so the context never fills
_quiet_log = None  # llama.cpp's log callback while the bench runs, kept here: C holds its pointer


def require_llama_cpp(needed_by: str) -> None:
    """A clear error that `needed_by` (a flag) needs llama-cpp-python, if it is not installed;
    nothing is loaded (the engine itself runs in another process)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(f"error: {needed_by} needs llama-cpp-python: pip install llama-cpp-python "
                         "(pip builds it from source, several minutes)")


def import_llama_cpp(needed_by: str):
    """llama-cpp-python's module with its log silenced (it prints every load step and tensor),
    or a clear error that `needed_by` (a flag) needs it."""
    global _quiet_log
    require_llama_cpp(needed_by)
    import llama_cpp
    if _quiet_log is None:
        _quiet_log = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p())
    return llama_cpp


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int, max_sequences: int, tokens_per_sequence: int):
        lib = import_llama_cpp("--compare llama.cpp")
        start = time.perf_counter()
        self.lib = lib
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(gguf_path.encode(), lib.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"error: llama.cpp could not load {gguf_path}")
        params = lib.llama_context_default_params()
        params.n_ctx = tokens_per_sequence * max_sequences
        params.n_batch = STEP_TOKENS
        params.n_seq_max = max_sequences
        params.kv_unified = False
        # Flash attention off, as llama-cpp-python's own Llama has it (and as ik_llama.cpp runs here).
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"error: llama.cpp could not make a context of {max_sequences} x "
                             f"{tokens_per_sequence} tokens")
        self.batch = lib.llama_batch_init(STEP_TOKENS, 0, 1)
        self.startup_s = time.perf_counter() - start
        self.compile_s = 0.0
        self.dtype = "the file's types"

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _clear_cache(self) -> None:
        # The cells only: zeroing the buffers too (data=True) writes the whole W1-sized cache inside
        # every timed request, which llama.cpp's server never does between requests (RESULTS.md).
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), False)

    @contextlib.contextmanager
    def _sampling(self, temperature: float, seed: int = 0) -> Iterator:
        """sample(row): the token drawn from the logits of the batch's row `row`."""
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if temperature > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        else:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        try:
            yield lambda row: lib.llama_sampler_sample(chain, self.ctx, row)
        finally:
            lib.llama_sampler_free(chain)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> None:
        with self._sampling(temperature) as sample:
            self._generate(prompts, max_tokens, sample)

    def _generate(self, prompts: list[list[int]], max_tokens: list[int], sample) -> None:
        lib, batch = self.lib, self.batch
        self._clear_cache()
        pending = [list(p) for p in prompts]  # each request's tokens not yet decoded
        position = [0] * len(prompts)
        left = list(max_tokens)
        running = [i for i in range(len(prompts)) if left[i] > 0]
        while running:
            # Requests with one token pending (decodes) go first, then prompt chunks.
            order = sorted(running, key=lambda i: len(pending[i]) > 1)
            n, samples = 0, []
            for i in order:
                take = min(len(pending[i]), STEP_TOKENS - n)
                if take == 0:
                    break
                for j in range(take):
                    batch.token[n] = pending[i][j]
                    batch.pos[n] = position[i] + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = i
                    batch.logits[n] = False
                    n += 1
                del pending[i][:take]
                position[i] += take
                if not pending[i]:  # the request's last token: sample after it
                    batch.logits[n - 1] = True
                    samples.append((i, n - 1))
            batch.n_tokens = n
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (the context is too small for the workload?)")
            for i, row in samples:
                token = sample(row)
                left[i] -= 1
                if left[i] > 0:
                    pending[i].append(token)
                else:
                    running.remove(i)


@contextlib.contextmanager
def busy_neighbour(gguf_path: str, threads: int) -> Iterator[int]:
    """The neighbour process (its pid), decoding from its first yield until the block ends,
    however it ends."""
    from nanovllm import user_environment
    require_llama_cpp("--contention")  # here, not in the child, for the clear error
    # stdout carries the one "ready" line; stderr is the user's, for a failure's own words.
    process = subprocess.Popen([sys.executable, "-m", __name__, gguf_path, str(threads)],
                               stdout=subprocess.PIPE, text=True, env=user_environment())
    try:
        if process.stdout.readline().strip() != "ready":
            raise SystemExit(f"error: the --contention neighbour could not run llama.cpp on {gguf_path}")
        yield process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def run_neighbour(gguf_path: str, threads: int) -> None:
    from nanovllm.entrypoints.bench_engine_process import run_as_users_run_it
    run_as_users_run_it()  # a neighbour as llama.cpp's users run it: their OpenMP policy, no torch
    llama_cpp = import_llama_cpp("--contention")
    parent = os.getppid()
    llm = llama_cpp.Llama(gguf_path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(NEIGHBOUR_PROMPT) + NEIGHBOUR_TOKENS, verbose=False)
    print("ready", flush=True)
    # A bench killed outright never terminates us: a new parent means it is gone.
    while os.getppid() == parent:
        for _ in itertools.islice(llm.generate(NEIGHBOUR_PROMPT, top_k=1), NEIGHBOUR_TOKENS):
            pass


if __name__ == "__main__":
    run_neighbour(sys.argv[1], int(sys.argv[2]))


class LlamaCppLookupRunner:
    name = "llama.cpp+lookup"

    def __init__(self, gguf_path: str, threads: int, tokens_per_sequence: int, draft_tokens: int):
        lib = import_llama_cpp("--compare llama.cpp")
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        start = time.perf_counter()
        self.llm = lib.Llama(gguf_path, n_ctx=tokens_per_sequence, n_batch=STEP_TOKENS, n_threads=threads,
                             n_threads_batch=threads, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens),
                             verbose=False)
        self.eos = self.llm.token_eos()
        self.startup_s = time.perf_counter() - start
        self.compile_s = 0.0
        self.dtype = f"the file's types, prompt lookup of {draft_tokens} tokens"

    def close(self) -> None:
        self.llm.close()

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> None:
        import numpy as np

        def no_eos(_, logits: np.ndarray) -> np.ndarray:  # as the other runners: EOS ignored
            logits[self.eos] = -np.inf
            return logits

        for prompt, n in zip(prompts, max_tokens):
            self.llm.reset()
            produced = 0
            for _ in self.llm.generate(prompt, temp=temperature, logits_processor=[no_eos], reset=True):
                produced += 1
                if produced == n:
                    break
