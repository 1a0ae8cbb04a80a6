"""The platform a model is being built for, in force while its modules are constructed
(`built_for`). Modules that decide per platform ask it in their constructors: an elementwise op
which forward it runs (custom_op.py), the decoder stack how its layers run (decoder_layers.py).
Outside `built_for` (a module made in a test or a tool) they take the plain choice: native
forwards, layers called in turn.
"""

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_platform: ContextVar[object | None] = ContextVar("platform_being_built_for", default=None)


@contextlib.contextmanager
def built_for(platform) -> Iterator[None]:
    """Build modules in this block for `platform` (a platforms.Platform)."""
    token = _platform.set(platform)
    try:
        yield
    finally:
        _platform.reset(token)


def platform_being_built_for():
    """The platform of the enclosing `built_for`, or None."""
    return _platform.get()
