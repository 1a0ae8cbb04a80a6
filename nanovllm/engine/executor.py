"""Rank 0's side of tensor parallelism, around its model runner: start (or wait for) the other
ranks, send them the config, broadcast each step before running it, turn a dead worker into a
clear error, and stop them all on shutdown, garbage collection, interpreter exit or failure.

Rank 0 is the user's process: it owns the scheduler and is the only rank that samples.
Without torchrun-style variables it spawns the other ranks on this machine; with them
(RANK=0 among WORLD_SIZE ranks) it waits for ranks started elsewhere (see
nanovllm/distributed/__main__.py).
"""

import multiprocessing.connection
import signal
import time
import weakref
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import EngineConfig
from nanovllm.distributed.parallel_state import init_cpu_group, make_tp_group
from nanovllm.distributed.rendezvous import JOINED_KEY, RENDEZVOUS_TIMEOUT, launch_env, open_store
from nanovllm.engine.step_messages import StepSender, broadcast
from nanovllm.engine.tp_worker import run_spawned
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sampler import SamplerOutput

# A peer's closed connection can reach rank 0 a moment before the peer's exit does.
DEATH_GRACE_S = 2.0
# How long stopped workers get to exit on their own before they are terminated.
SHUTDOWN_GRACE_S = 5.0
SPAWN_HINT = (". Note: a script that creates a tensor-parallel LLM must do so under "
              "`if __name__ == '__main__':`, as workers are started with multiprocessing's spawn")


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run another step."""


def make_executor(config: EngineConfig) -> "ModelRunner | TPExecutor":
    """What the engine drives: the model runner itself for tp=1, a TPExecutor around it otherwise.
    Both offer `execute`, `survives`, `num_kvcache_blocks` and `kv_sliding_window`."""
    return ModelRunner(config) if config.tensor_parallel_size == 1 else TPExecutor(config)


class Workers:
    """The other ranks as rank 0 sees them: the processes it spawned (none when they were
    started independently), and what state they are in."""

    def __init__(self, procs: list[mp.Process], rank0_num_threads: int | None = None):
        self.procs = procs
        self.rank0_num_threads = rank0_num_threads  # torch's thread count to give back to rank 0
        self.connected = False  # this process joined the default process group
        self.idle = False  # every rank waits for rank 0's next message, so one can be sent
        self.closed = False

    def check_alive(self, hint: str = "") -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                raise WorkerDiedError(_death(rank, proc) + hint)

    def failure(self, error: BaseException) -> BaseException:
        """What to raise for `error`: a clear message if a worker died, else `error` itself."""
        if not self.procs or not isinstance(error, RuntimeError) or isinstance(error, WorkerDiedError):
            return error
        exiting = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=DEATH_GRACE_S)
        for proc in self.procs:
            if proc.sentinel in exiting:
                # Its descriptors are closed, so it is in the middle of exiting; join (with no
                # timeout: a timed join can return just before the exit code is there) reaps it.
                proc.join()
        dead = [_death(rank, p) for rank, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        return WorkerDiedError("; ".join(dead)) if dead else error

    def wait_until_joined(self, store: dist.Store, world_size: int) -> None:
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while (joined := store.add(JOINED_KEY, 0)) < world_size - 1:
            self.check_alive(hint=SPAWN_HINT)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {joined} of the {world_size - 1} other tensor-parallel ranks joined within "
                    f"{RENDEZVOUS_TIMEOUT}; start each with `python -m nanovllm.distributed` and the "
                    "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE")
            time.sleep(0.02)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.idle:
            try:
                broadcast(None, settle=True)  # "stop": workers leave their loop and exit
            except RuntimeError:
                pass  # a worker is dead; the others are terminated below
        # Between steps workers exit on their own; mid-step (an error, Ctrl-C) they may be
        # blocked in a collective that will never complete, so they are terminated at once.
        for proc in self.procs:
            proc.join(SHUTDOWN_GRACE_S if self.idle else 0)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(SHUTDOWN_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.connected:
            # Also closes the connections of workers started elsewhere, which then exit.
            dist.destroy_process_group()
        if self.rank0_num_threads is not None:
            torch.set_num_threads(self.rank0_num_threads)


class TPExecutor:
    """Rank 0 under tensor parallelism: its own model runner (`runner`), and the other ranks,
    which it sends each step before running it."""

    def __init__(self, config: EngineConfig):
        world_size = config.tensor_parallel_size
        self.error: BaseException | None = None  # what stopped the engine, if anything did
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process (is another "
                               "tensor-parallel LLM still alive?); shut it down first")
        env = launch_env()
        if env is None:
            if config.device == "cuda" and torch.cuda.device_count() < world_size:
                raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                                 f"this machine has {torch.cuda.device_count()}")
            store = open_store("127.0.0.1", 0, world_size, is_master=True)  # a free port: engines never collide
            num_threads = torch.get_num_threads()
            if config.device == "cpu":
                # The ranks share this machine's cores; oversubscribed threads stall every collective.
                torch.set_num_threads(max(1, num_threads // world_size))
            self.workers = Workers(_spawn_workers(world_size, store.port, torch.get_num_threads()), num_threads)
            local_rank = 0
        else:
            if env.rank != 0 or env.world_size != world_size:
                raise ValueError(
                    f"RANK={env.rank}, WORLD_SIZE={env.world_size}: the LLM with tensor_parallel_size="
                    f"{world_size} runs on RANK=0 with WORLD_SIZE={world_size}; the other ranks run "
                    "`python -m nanovllm.distributed`")
            store = open_store(env.master_addr, env.master_port, world_size, is_master=not env.agent_store)
            self.workers = Workers([])
            local_rank = env.local_rank
        # Registered before anything can fail: runs on shutdown(), garbage collection and exit.
        self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            self.workers.wait_until_joined(store, world_size)
            init_cpu_group(store, 0, world_size)
            self.workers.connected = True
            broadcast(config)
            if config.device == "cuda":
                torch.cuda.set_device(local_rank)
            self.runner = ModelRunner(config, make_tp_group(torch.device(config.device)))
        except BaseException as e:
            self._fail(e)
        self.steps = StepSender()
        self.workers.idle = True

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        if self.workers.closed:
            raise RuntimeError("this tensor-parallel engine is shut down" if self.error is None else
                               f"this tensor-parallel engine stopped after an error ({self.error!r}); "
                               "create a new LLM")
        self.workers.idle = False
        try:
            self.workers.check_alive()
            broadcast(self.steps.encode(batch))
            out = self.runner.execute(batch)
        except BaseException as e:
            self._fail(e)
        self.workers.idle = True
        return out

    @property
    def num_kvcache_blocks(self) -> int:
        return self.runner.num_kvcache_blocks  # agreed by all ranks

    @property
    def kv_sliding_window(self) -> int | None:
        return self.runner.kv_sliding_window  # every rank builds the same layers

    @property
    def compile_seconds(self) -> float:
        return self.runner.compile_seconds

    def survives(self, error: Exception) -> bool:
        """Never: a failed step has stopped every rank (see _fail)."""
        return False

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group; idempotent."""
        self._finalizer()

    def _fail(self, e: BaseException) -> NoReturn:
        """Stop every rank (a half-run collective cannot be resumed) and raise a clear error."""
        error = self.workers.failure(e)  # before shutdown, which kills the workers itself
        self.error = error
        self._finalizer()
        if error is e:
            raise e
        raise error from e


def _spawn_workers(world_size: int, port: int, num_threads: int) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world_size):
        proc = ctx.Process(target=run_spawned, args=(rank, world_size, port, num_threads),
                           name=f"nanovllm-tp-rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def _death(rank: int, proc: mp.Process) -> str:
    code = proc.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}; its error, if any, is printed above"
