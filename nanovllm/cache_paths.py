"""Where nano-vllm keeps what a later start can reuse: one directory under the user's cache
directory (XDG_CACHE_HOME, else ~/.cache), a subdirectory per kind of artifact."""

import os


def user_cache_dir(kind: str) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nanovllm", kind)
