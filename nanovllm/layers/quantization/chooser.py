"""Which linear method each layer is built with: asked once by every linear layer, embedding and
LM head in its constructor (vLLM's `get_quant_method(layer, prefix)`), so that nothing is swapped
after load.

The chooser knows the checkpoint's block types (checkpoint tensor name -> GGML type) and the
model's packed modules, so from a layer's prefix it finds the checkpoint tensors that load into
it. A layer whose tensors all come in block types takes the platform's block method for them
(Platform.block_linear_method, told too which projection of its block the layer is: the last
name of its prefix), where the platform has one and the layer's input width holds whole blocks;
the rest take the platform's dense method (Platform.dense_linear_method), and their tensors are
dequantized at load; an embedding that only looks rows up stays plain.
`kept_in_blocks` then names the tensors the checkpoint yields as blocks.

A mixture of experts' FusedMoE layer asks for its MoE method the same way (`moe_method_for`):
where every expert's gate and up come in one block type and every down in one (maybe another),
the platform's block MoE method (Platform.block_moe_method), else its dense one.
"""

import logging
from collections import defaultdict

from torch import nn

from nanovllm.layers.quantization.base import LinearMethod
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod
from nanovllm.loader.weights import packed_target, shards_of

logger = logging.getLogger(__name__)


class LinearMethodChooser:
    """`platform`: a Platform (platforms/__init__.py); `block_types`: checkpoint tensor name ->
    GGML type of the tensors the checkpoint can yield in blocks; `packed_modules_mapping`: the
    model class's (checkpoint module name -> (packed module name, shard id)), and
    `expert_params_mapping` its experts' (loader/weights.py)."""

    def __init__(self, platform, block_types: dict[str, str], packed_modules_mapping: dict[str, tuple[str, object]],
                 expert_params_mapping: dict[str, str] | None = None):
        self.platform = platform
        self.shards_of = shards_of(packed_modules_mapping)
        # Layer prefix -> shard id -> (checkpoint name, GGML type), for linear layers' weights and
        # for experts' (shard id (expert, projection)).
        self.parts: dict[str, dict[object, tuple[str, str]]] = defaultdict(dict)
        for name, qtype in block_types.items():
            target, shard_id = packed_target(name, packed_modules_mapping, expert_params_mapping)
            module_name, _, param_name = target.rpartition(".")
            if param_name in ("weight", "w13_weight", "w2_weight"):
                self.parts[module_name][shard_id] = (name, qtype)
        self.kept_in_blocks: dict[str, str] = {}  # checkpoint name -> GGML type
        self.dequantized: dict[str, int] = defaultdict(int)  # the types of the layers left dense -> layers

    def method_for(self, layer: nn.Module, prefix: str, input_size: int, multiplies: bool = True,
                   batch_invariant: bool = False) -> LinearMethod:
        """The method of `layer` (named `prefix` in the model), whose weight rows hold `input_size`
        values on this rank; `multiplies` False for an embedding that only looks rows up;
        `batch_invariant` for a layer whose rows must not depend on the step's other rows even when
        its weight is dense (a router, whose choices a request's tokens hang on)."""
        shards = self.parts.get(prefix)
        if shards:
            method = self._block_method(prefix, shards, input_size)
            if method is not None:
                self.kept_in_blocks.update(shards.values())
                return method
            self.dequantized["/".join(sorted({qtype for _, qtype in shards.values()}))] += 1
        return self.platform.dense_linear_method(batch_invariant) if multiplies else UnquantizedLinearMethod()

    def _block_method(self, prefix: str, shards: dict[object, tuple[str, str]], input_size: int) -> LinearMethod | None:
        # Imported here: loader.quantized pulls in gguf-py, which only block weights need.
        from nanovllm.loader.quantized import block_values

        qtypes = {qtype for _, qtype in shards.values()}
        # A packed layer with a part in no block type, or a row-parallel shard narrower than a
        # block, stays dense.
        name = prefix.rpartition(".")[2]
        whole = (shards.keys() == self.shards_of.get(name, {None})
                 and not any(input_size % block_values(qtype) for qtype in qtypes))
        if not whole:
            return None
        return self.platform.block_linear_method({shard: qtype for shard, (_, qtype) in shards.items()}, name)

    def moe_method_for(self, layer: nn.Module, prefix: str, hidden_size: int, intermediate_size: int):
        """The MoE method of FusedMoE `layer` (named `prefix`), whose experts' rows hold `hidden_size`
        (gate, up) and `intermediate_size` (down, this rank's share) values."""
        from nanovllm.loader.quantized import block_values

        shards = self.parts.get(prefix)
        if shards:
            gate_up = {qtype for (_, projection), (_, qtype) in shards.items() if projection != "down"}
            down = {qtype for (_, projection), (_, qtype) in shards.items() if projection == "down"}
            whole = (len(shards) == 3 * layer.num_experts and len(gate_up) == len(down) == 1
                     and hidden_size % block_values(*gate_up) == 0 and intermediate_size % block_values(*down) == 0)
            method = self.platform.block_moe_method(gate_up.pop(), down.pop()) if whole else None
            if method is not None:
                self.kept_in_blocks.update(shards.values())
                return method
            self.dequantized["/".join(sorted({qtype for _, qtype in shards.values()}))] += 1
        return self.platform.dense_moe_method()

    def log_dequantized(self) -> None:
        """One line counting the layers whose block weights are dequantized at load, if any."""
        if self.dequantized:
            counts = ", ".join(f"{n} {t}" for t, n in sorted(self.dequantized.items()))
            logger.info("dequantizing at load the weights of %d layers this platform does not run in blocks (%s)",
                        sum(self.dequantized.values()), counts)


def choose_linear_method(linear_methods: LinearMethodChooser | None, layer: nn.Module, prefix: str, input_size: int,
                         multiplies: bool = True, batch_invariant: bool = False) -> LinearMethod:
    """The chooser's method for `layer`, or the plain one for a layer built without a chooser (a
    test's, or a model built outside an engine)."""
    if linear_methods is None:
        return UnquantizedLinearMethod()
    return linear_methods.method_for(layer, prefix, input_size, multiplies, batch_invariant)
