"""Start-up phases: how long each took (importing, reading the checkpoint, the tokenizer, the
CPU kernels, the weights, the KV cache, compiling), each logged at debug level as it ends and
summed up in one line when the engine is ready (`--log-level debug` on the command line)."""

import contextlib
import logging
import time

logger = logging.getLogger(__name__)

_phases: list[tuple[str, float]] = []


def record(name: str, seconds: float) -> None:
    _phases.append((name, seconds))
    logger.debug("start-up: %s took %.2f s", name, seconds)


@contextlib.contextmanager
def phase(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - start)


def log_breakdown(total_seconds: float) -> None:
    """One line of the phases recorded since the last breakdown, then start afresh (a process
    may start several engines)."""
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in _phases)
    logger.debug("start-up: engine ready, built in %.2f s; phases: %s", total_seconds, parts)
    _phases.clear()
