"""Strict weight loading: checkpoint tensors (HF names) into a model's parameters.

Every checkpoint tensor must land in exactly one parameter, and every parameter (every
shard of a packed one) must be loaded; otherwise loading fails naming the mismatch.
Packed parameters (`qkv_proj`, `gate_up_proj`) are found through the model's
`packed_modules_mapping`; each parameter's `weight_loader` knows how to cut its own
tensor-parallel shard out of the full checkpoint tensor.
"""

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

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


def _packed_target(name: str, mapping: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """Map a checkpoint name to (parameter name, shard id); shard id None when not packed."""
    for source, (packed, shard_id) in mapping.items():
        part = f".{source}."
        if part in name:
            return name.replace(part, f".{packed}.", 1), shard_id
    return name, None


def _shards_of(mapping: dict[str, tuple[str, object]]) -> dict[str, set[object]]:
    shards: dict[str, set[object]] = defaultdict(set)
    for packed, shard_id in mapping.values():
        shards[packed].add(shard_id)
    return shards


def keep_in_blocks(model: nn.Module, block_types: dict[str, str],
                   method_for: Callable[[dict[object, str]], object | None]) -> dict[str, str]:
    """Switch each layer whose checkpoint tensors all come in block formats (`block_types`:
    checkpoint name -> GGML type) onto the linear method `method_for(shard types)` gives (see
    Platform.block_linear_method), where it gives one; returns the checkpoint names to load as
    blocks. Layers that share a weight (a tied LM head and its embedding) switch together. The
    others stay dense and their tensors are dequantized: a packed layer with a part in a type
    the platform does not run, or a shard narrower than a block; one log line counts them."""
    # Imported here: every layer imports this module, and loader.quantized pulls in gguf.
    from nanovllm.loader.quantized import block_values

    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    shards_of = _shards_of(mapping)
    parts: dict[str, dict[object, tuple[str, str]]] = defaultdict(dict)
    for name, qtype in block_types.items():
        target, shard_id = _packed_target(name, mapping)
        parts[target][shard_id] = (name, qtype)
    modules = dict(model.named_modules())
    holders: dict[int, list[nn.Module]] = defaultdict(list)  # weight id -> the modules holding it
    for module in modules.values():
        if isinstance(getattr(module, "weight", None), torch.Tensor):
            holders[id(module.weight)].append(module)
    kept, dense = {}, defaultdict(int)
    for target, shards in parts.items():
        module_name, _, param_name = target.rpartition(".")
        module = modules.get(module_name)
        if param_name != "weight" or not hasattr(module, "linear_method"):
            continue
        qtypes = {qtype for _, qtype in shards.values()}
        whole = (shards.keys() == shards_of.get(module_name.split(".")[-1], {None})
                 and not any(module.weight.shape[1] % block_values(qtype) for qtype in qtypes))
        method = method_for({shard_id: qtype for shard_id, (_, qtype) in shards.items()}) if whole else None
        if method is None:
            dense["/".join(sorted(qtypes))] += 1
            continue
        old_weight = module.weight
        method.install(module)
        for other in holders[id(old_weight)]:  # layers tied to this weight take the blocks and the method
            if other is not module:
                other.weight, other.linear_method = module.weight, method
        kept.update(shards.values())
    if dense:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(dense.items()))
        logger.info("dequantizing at load the weights of %d layers this platform does not run in blocks (%s)",
                    sum(dense.values()), counts)
    return kept


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    mapping: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    # Tied weights appear once in `params`; their other names (e.g. lm_head.weight when
    # the head reuses the embedding) are aliases a checkpoint may still carry.
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()

    loaded: dict[str, set[object]] = defaultdict(set)
    unexpected: list[str] = []
    for name, tensor in weights:
        if name in aliases or name.endswith(_DERIVED_SUFFIXES):
            continue
        target, shard_id = _packed_target(name, mapping)
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

    shards_of = _shards_of(mapping)
    missing = []
    for name in params:
        module_name = name.split(".")[-2] if "." in name else ""
        expected = shards_of.get(module_name, {None})
        missing += [name if s is None else f"{name} (shard {s!r})" for s in expected - loaded[name]]

    if unexpected or missing:
        raise ValueError(
            "checkpoint does not match the model: "
            f"unexpected tensors {sorted(unexpected)}; missing parameters {sorted(missing)}"
        )
