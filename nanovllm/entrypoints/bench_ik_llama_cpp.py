"""ik_llama.cpp (a llama.cpp fork) as a comparison engine for `nanovllm bench --compare
ik_llama.cpp`, through ik-llama-cpp-python's ctypes API (an optional extra: `pip install
ik-llama-cpp-python`; its module is `ik_llama_cpp`, beside llama-cpp-python's `llama_cpp`).

The same GGUF file, thread count and workloads as the llama.cpp runner (bench_llama_cpp), driven
by the same loop (a sequence id a request, batches of up to 2,048 tokens, decodes first), with
ik_llama.cpp's run-time repack on: at load, the weights are repacked into its interleaved rows
for the CPU kernels (`-rtr` in its tools). Its API is llama.cpp's older one: the KV cache is
emptied by `llama_kv_cache_seq_rm`, greedy tokens are the logits' argmax and sampled ones are
drawn by its `llama_sample_temp` and `llama_sample_token` (seeded by the context's seed). Its
flash attention is left off: in the PyPI wheel its kernels assert (`S > 0`) on W1's batches, seen
on an AMD EPYC Zen 3 (AVX2) and an Intel Xeon with AVX-512 VNNI and AMX alike.
"""

import contextlib
import ctypes
import time
from collections.abc import Iterator

import numpy as np

from nanovllm.entrypoints.bench_llama_cpp import STEP_TOKENS, LlamaCppRunner


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class IkLlamaCppRunner(LlamaCppRunner):
    name = "ik_llama.cpp"

    def __init__(self, gguf_path: str, threads: int, max_sequences: int, tokens_per_sequence: int, seed: int = 0):
        try:
            import ik_llama_cpp._ctypes_api as lib
        except ImportError as e:
            raise SystemExit("error: --compare ik_llama.cpp needs ik-llama-cpp-python: pip install "
                             "ik-llama-cpp-python") from e
        start = time.perf_counter()
        self.lib = lib
        # Its log (every load step and tensor) silenced as bench_llama_cpp silences llama.cpp's;
        # the binding declares no llama_log_set, the library has it. The callback is kept: C holds it.
        self._quiet_log = _LOG_CALLBACK(lambda level, text, data: None)
        lib._lib.llama_log_set(self._quiet_log, ctypes.c_void_p())
        self._remove_cells = lib._lib.llama_kv_cache_seq_rm  # in the library, not declared by the binding
        self._remove_cells.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
        self._remove_cells.restype = ctypes.c_bool
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.repack_tensors = True
        self.model = lib.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise SystemExit(f"error: ik_llama.cpp could not load {gguf_path}")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        params = lib.llama_context_default_params()
        params.seed = seed
        params.n_ctx = tokens_per_sequence * max_sequences
        params.n_batch = STEP_TOKENS
        params.n_seq_max = max_sequences
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn = False
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"error: ik_llama.cpp could not make a context of {max_sequences} x "
                             f"{tokens_per_sequence} tokens")
        self.batch = lib.llama_batch_init(STEP_TOKENS, 0, 1)
        self.startup_s = time.perf_counter() - start
        self.compile_s = 0.0
        self.dtype = "the file's types, repacked"

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_free_model(self.model)

    def _clear_cache(self) -> None:
        # Every sequence's cells removed, as the llama.cpp runner's clear: llama_kv_cache_clear would
        # also zero the whole W1-sized cache inside every timed request.
        self._remove_cells(self.ctx, -1, -1, -1)

    def _logits(self, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.vocab,))

    @contextlib.contextmanager
    def _sampling(self, temperature: float, seed: int = 0) -> Iterator:
        lib = self.lib
        if temperature <= 0:
            yield lambda row: int(self._logits(row).argmax())
            return
        data = (lib.llama_token_data * self.vocab)()
        candidates = np.ctypeslib.as_array(data)  # a structured view: id, logit, p
        ids = np.arange(self.vocab, dtype=np.int32)

        def sample(row: int) -> int:
            candidates["id"], candidates["logit"], candidates["p"] = ids, self._logits(row), 0.0
            array = lib.llama_token_data_array(data, self.vocab, -1, False)
            lib.llama_sample_temp(self.ctx, ctypes.byref(array), temperature)
            return lib.llama_sample_token(self.ctx, ctypes.byref(array))

        yield sample
