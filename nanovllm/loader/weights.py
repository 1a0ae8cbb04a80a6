"""Strict weight loading: checkpoint tensors (HF names) into a model's parameters.

Every checkpoint tensor must land in exactly one parameter, and every parameter (every
shard of a packed one) must be loaded; otherwise loading fails naming the mismatch.
Packed parameters (`qkv_proj`, `gate_up_proj`) are found through the model's
`packed_modules_mapping`; a mixture of experts' per-expert tensors
(`<block>.experts.<e>.<projection>.weight`) through its `expert_params_mapping` (checkpoint
projection name -> "gate", "up" or "down"), which loads them into the block's
`experts.w13_weight` (gate and up) and `experts.w2_weight` (down) with shard id (e, projection).
A parameter whose shards are not its module's packed ones lists them itself (`shard_ids`).
Each parameter's `weight_loader` knows how to cut its own tensor-parallel shard out of the full
checkpoint tensor.
"""

import re
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

# Old Llama checkpoints store the rotary inverse frequencies; we recompute them, so they
# are the one kind of checkpoint tensor that is expected to land nowhere.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copy a whole tensor into `param` (converting dtype), refusing a shape mismatch."""
    if shard_id is not None:
        raise ValueError(f"unpacked parameter got shard {shard_id!r}")
    if param.shape != loaded_weight.shape:
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


_EXPERT_TENSOR = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
# The fused experts' parameters each projection loads into.
EXPERT_PARAMS = {"gate": "w13_weight", "up": "w13_weight", "down": "w2_weight"}


def packed_target(name: str, mapping: dict[str, tuple[str, object]],
                  expert_mapping: dict[str, str] | None = None) -> tuple[str, object]:
    """Map a checkpoint name to (parameter name, shard id); shard id None when not packed."""
    match = _EXPERT_TENSOR.fullmatch(name) if expert_mapping else None
    if match and match.group(3) in expert_mapping:
        projection = expert_mapping[match.group(3)]
        return f"{match.group(1)}.{EXPERT_PARAMS[projection]}", (int(match.group(2)), projection)
    for source, (packed, shard_id) in mapping.items():
        part = f".{source}."
        if part in name:
            return name.replace(part, f".{packed}.", 1), shard_id
    return name, None


def shards_of(mapping: dict[str, tuple[str, object]]) -> dict[str, set[object]]:
    """Each packed module's name (its last component) -> the shard ids that fill it."""
    shards: dict[str, set[object]] = defaultdict(set)
    for packed, shard_id in mapping.values():
        shards[packed].add(shard_id)
    return shards


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    expert_mapping: dict[str, str] = getattr(model, "expert_params_mapping", {})
    params = dict(model.named_parameters())
    # Tied weights appear once in `params`; their other names (e.g. lm_head.weight when
    # the head reuses the embedding) are aliases a checkpoint may still carry.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()

    loaded: dict[str, set[object]] = defaultdict(set)
    unexpected: list[str] = []
    for name, tensor in weights:
        if name in aliases or name.endswith(_DERIVED_SUFFIXES):
            continue
        target, shard_id = packed_target(name, mapping, expert_mapping)
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        if shard_id in loaded[target]:
            raise ValueError(f"checkpoint tensor {name} loaded twice (into {target})")
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name} -> {target}: {e}") from e
        loaded[target].add(shard_id)

    expected_shards = shards_of(mapping)
    missing = []
    for name in params:
        module_name = name.split(".")[-2] if "." in name else ""
        expected = getattr(params[name], "shard_ids", None) or expected_shards.get(module_name, {None})
        missing += [name if s is None else f"{name} (shard {s!r})" for s in expected - loaded[name]]

    if unexpected or missing:
        raise ValueError(
            "checkpoint does not match the model: "
            f"unexpected tensors {sorted(unexpected)}; missing parameters {sorted(missing)}"
        )
