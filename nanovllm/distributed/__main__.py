"""`python -m nanovllm.distributed`: one rank of a tensor-parallel engine whose ranks are
started independently (by hand on each machine, or by torchrun), configured by torchrun's
variables MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK and LOCAL_RANK (the GPU to use).

    python -m nanovllm.distributed                     # a rank other than 0: serve rank 0
    python -m nanovllm.distributed script.py [args]    # rank 0 runs the script, others serve

Rank 0 may as well run `python script.py`; the second form suits torchrun, which runs one
command on every rank.
"""

import os
import runpy
import sys

from nanovllm.distributed.rendezvous import launch_env, open_store
from nanovllm.engine.tp_worker import exit_now, serve


def main(argv: list[str]) -> None:
    env = launch_env()
    if env is None:
        sys.exit("set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun does) to start a tensor-parallel rank")
    if env.rank == 0:
        if not argv:
            sys.exit("rank 0 runs your script, which creates the LLM: python -m nanovllm.distributed script.py [args]")
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would
        runpy.run_path(argv[0], run_name="__main__")
        return
    serve(open_store(env.master_addr, env.master_port, env.world_size, is_master=False),
          env.rank, env.world_size, env.local_rank)
    exit_now()


if __name__ == "__main__":
    main(sys.argv[1:])
