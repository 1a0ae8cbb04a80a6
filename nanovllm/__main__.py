"""`python -m nanovllm`: the same command line as the `nanovllm` script."""

from nanovllm.entrypoints.cli import run

# Guarded: tensor-parallel ranks are started with multiprocessing's spawn, which imports this
# module again in each of them.
if __name__ == "__main__":
    run()
