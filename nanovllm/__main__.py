"""`python -m nanovllm`: the same command line as the `nanovllm` script."""

from nanovllm.entrypoints.cli import main

raise SystemExit(main())
