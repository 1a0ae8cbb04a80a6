"""The other ranks' side of tensor parallelism: join rank 0, build the same model runner
from the config rank 0 sends, and run every step rank 0 broadcasts until it says stop.

Rank 0 spawns these on its own machine (`run_spawned`), or they are started independently,
torchrun-style, with `python -m nanovllm.distributed` (see __main__.py).
"""

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from nanovllm.distributed.parallel_state import init_cpu_group, make_tp_group
from nanovllm.distributed.rendezvous import JOINED_KEY, open_store
from nanovllm.engine.step_messages import StepReceiver, receive
from nanovllm.engine.model_runner import ModelRunner


def serve(store: dist.Store, rank: int, world_size: int, local_rank: int) -> None:
    """Join the group, then run rank 0's steps until it broadcasts None (shutdown)."""
    store.add(JOINED_KEY, 1)
    init_cpu_group(store, rank, world_size)
    try:
        config = receive()
        if config.device == "cuda":
            torch.cuda.set_device(local_rank)
        runner = ModelRunner(config, make_tp_group(torch.device(config.device)))
        steps = StepReceiver()
        while (message := receive()) is not None:
            runner.execute(steps.decode(message))
    finally:
        dist.destroy_process_group()


def run_spawned(rank: int, world_size: int, port: int, num_threads: int) -> None:
    """Entry point of a worker that rank 0 spawned on this machine."""
    # Ctrl-C reaches every process of the terminal's group; rank 0 alone decides what
    # happens next (it stops us), so a half-finished step never strands it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    torch.set_num_threads(num_threads)
    serve(open_store("127.0.0.1", port, world_size, is_master=False), rank, world_size, local_rank=rank)
    exit_now()


def _exit_with_parent() -> None:
    """Exit as soon as rank 0's process is gone, even if it was killed without cleaning up."""
    parent = multiprocessing.parent_process()

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        print(f"nano-vllm worker {os.getpid()}: rank 0 (pid {parent.pid}) is gone; exiting", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="watch-rank0", daemon=True).start()


def exit_now() -> None:
    """End a worker that served to the end. Interpreter teardown is skipped: there is nothing
    left to clean up, and tearing down torch's threads at exit can abort the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
