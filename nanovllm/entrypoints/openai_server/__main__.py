"""`python -m nanovllm.entrypoints.openai_server ARGS`: the same as `nanovllm serve ARGS`."""

import sys

from nanovllm.entrypoints.cli import main as cli_main

sys.exit(cli_main(["serve", *sys.argv[1:]]))
