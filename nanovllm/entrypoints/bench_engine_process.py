"""A comparison engine of `nanovllm bench` (llama.cpp, ik_llama.cpp) in a process of its own.

In nano-vllm's process such an engine would share torch's OpenMP runtime (one libgomp, loaded
once) and with it the passive wait policy nano-vllm sets for torch's threads (nanovllm/__init__):
its threads would then sleep at each of the hundreds of barriers of a token, which measured
llama.cpp's decode at about half of its own rate (benchmarks/RESULTS.md). Here it runs as its
users run it: a process that never loads torch, in the environment the user gave the bench.

EngineProcess (the bench's side) starts `python -m nanovllm.entrypoints.bench_engine_process`,
whose `serve` builds the runner and answers over two pipes; each message is a pickled tuple.
The bench times each `generate` round trip, which a pipe adds well under a millisecond to.
"""

import os
import pickle
import subprocess
import sys
import traceback


def run_as_users_run_it() -> None:
    """Give this process the user's environment back, before any engine's libraries load."""
    from nanovllm import user_environment
    if "torch" in sys.modules:
        raise RuntimeError("torch is loaded already: the engine would share its OpenMP runtime")
    environment = user_environment()
    os.environ.clear()
    os.environ.update(environment)


def _runner(engine: str, gguf_path: str, threads: int, max_sequences: int, tokens_per_sequence: int,
            draft_tokens: int):
    if engine == "ik_llama.cpp":
        from nanovllm.entrypoints.bench_ik_llama_cpp import IkLlamaCppRunner as Runner
    elif engine == "llama.cpp+lookup":
        from nanovllm.entrypoints.bench_llama_cpp import LlamaCppLookupRunner
        return LlamaCppLookupRunner(gguf_path, threads, tokens_per_sequence, draft_tokens)
    else:
        from nanovllm.entrypoints.bench_llama_cpp import LlamaCppRunner as Runner
    return Runner(gguf_path, threads, max_sequences, tokens_per_sequence)


def serve(engine: str, gguf_path: str, threads: int, max_sequences: int, tokens_per_sequence: int,
          draft_tokens: int, requests, replies) -> None:
    """Build the runner, say what it is, then run each ("generate", prompts, max_tokens,
    temperature) request until the requests pipe closes. Every message gets one reply:
    ("ok", value), ("exit", message) for an error the user can act on, ("error", traceback)."""
    def reply(*message) -> None:
        pickle.dump(message, replies)
        replies.flush()

    run_as_users_run_it()
    try:
        runner = _runner(engine, gguf_path, threads, max_sequences, tokens_per_sequence, draft_tokens)
    except SystemExit as e:
        return reply("exit", str(e))
    reply("ok", {"dtype": runner.dtype, "startup_s": runner.startup_s,
                 "openmp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "torch_loaded": "torch" in sys.modules})
    try:
        while True:
            try:
                _, prompts, max_tokens, temperature = pickle.load(requests)
            except EOFError:  # the bench closed us, or ended
                return
            try:
                runner.generate(prompts, max_tokens, temperature)
            except Exception:
                reply("error", traceback.format_exc())
            else:
                reply("ok", None)
    finally:
        runner.close()


class EngineProcess:
    """The runner interface of the bench (name, dtype, startup_s, compile_s, generate, close)
    for an engine that runs in its own process."""

    def __init__(self, engine: str, gguf_path: str, threads: int, max_sequences: int, tokens_per_sequence: int,
                 draft_tokens: int = 0):
        """`draft_tokens`: llama.cpp+lookup's tokens a prompt lookup drafts."""
        from nanovllm import user_environment
        self.name = engine
        self.compile_s = 0.0
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        command = [sys.executable, "-m", __name__, engine, gguf_path, str(threads), str(max_sequences),
                   str(tokens_per_sequence), str(draft_tokens), str(requests_read), str(replies_write)]
        self.process = subprocess.Popen(command, pass_fds=(requests_read, replies_write), env=user_environment())
        os.close(requests_read)
        os.close(replies_write)
        self._requests = os.fdopen(requests_write, "wb")
        self._replies = os.fdopen(replies_read, "rb")
        try:
            info = self._reply()
        except BaseException:
            self.close()
            raise
        self.dtype, self.startup_s = info["dtype"], info["startup_s"]
        self.openmp_wait_policy, self.torch_loaded = info["openmp_wait_policy"], info["torch_loaded"]

    def _reply(self):
        try:
            kind, value = pickle.load(self._replies)
        except EOFError:
            raise RuntimeError(f"the {self.name} process ended without a reply "
                               f"(exit code {self.process.wait()})") from None
        if kind == "exit":
            raise SystemExit(value)
        if kind == "error":
            raise RuntimeError(f"{self.name} failed in its process:\n{value}")
        return value

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> None:
        pickle.dump(("generate", prompts, max_tokens, temperature), self._requests)
        self._requests.flush()
        self._reply()

    def close(self) -> None:
        """End the process (it stops at the closed pipe) and reap it."""
        if self._requests.closed:
            return
        self._requests.close()
        self._replies.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    engine, path, *numbers = sys.argv[1:]
    threads, max_sequences, tokens_per_sequence, draft_tokens, requests_fd, replies_fd = map(int, numbers)
    try:
        with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb") as replies:
            serve(engine, path, threads, max_sequences, tokens_per_sequence, draft_tokens, requests, replies)
    except BrokenPipeError:  # the bench ended (killed, say) while we ran its request
        sys.exit(1)
