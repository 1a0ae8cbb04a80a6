"""A sentence-transformers model directory's pooling: `modules.json` lists its modules (the
transformer, a Pooling module whose config.json says how it pools, an optional Normalize);
`pooling_defaults` turns them into the PoolerConfig a pooling model starts with.

Modules that would change the vector further (a Dense projection, ...) are refused by name:
the engine does not run them, and a vector without them would be silently wrong.
"""

import json
import os

from nanovllm.pooling_params import PoolerConfig

_TRANSFORMER, _POOLING, _NORMALIZE = (f"sentence_transformers.models.{name}"
                                      for name in ("Transformer", "Pooling", "Normalize"))
# Pooling/config.json's flags, by the pooling type each means.
_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                  "pooling_mode_cls_token": "CLS"}


def is_sentence_transformers(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "modules.json"))


def pooling_defaults(path: str, pooling_type_given: bool = False) -> PoolerConfig | None:
    """The pooling that model directory `path`'s sentence-transformers files state, or None when
    it has none. With `pooling_type_given` (the user chose one) its Pooling module's mode is not
    read, so a mode the engine does not run is no error then."""
    if not is_sentence_transformers(path):
        return None
    modules_file = os.path.join(path, "modules.json")
    try:
        with open(modules_file) as f:
            modules = json.load(f)
        types = [(module["type"], module.get("path", "")) for module in modules]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{modules_file} is not a sentence-transformers module list: {e}") from None
    others = [t for t, _ in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if others:
        raise ValueError(f"{modules_file} lists modules the engine does not run: {others}; it runs "
                         "Transformer, Pooling and Normalize only")
    pooling_type = None
    for module_type, module_path in types:
        if module_type == _POOLING and not pooling_type_given:
            pooling_type = _pooling_type(os.path.join(path, module_path, "config.json"))
    return PoolerConfig(pooling_type=pooling_type, normalize=any(t == _NORMALIZE for t, _ in types))


def _pooling_type(config_file: str) -> str | None:
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the sentence-transformers pooling config {config_file}: {e}") from None
    chosen = [kind for flag, kind in _POOLING_MODES.items() if config.get(flag)]
    other = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_MODES)
    if len(chosen) != 1 or other:
        modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
        raise ValueError(f"{config_file} pools by {modes or 'no mode'}; the engine pools by exactly one of "
                         f"{', '.join(_POOLING_MODES)}: give pooler_config={{'pooling_type': ...}} to choose")
    return chosen[0]
