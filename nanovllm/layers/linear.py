"""Linear layers, replicated or sharded over a tensor-parallel group.

Column-parallel layers split the output dim (weight rows): each rank computes a slice of
the output and no communication is needed. Row-parallel layers split the input dim
(weight columns): each rank computes a partial sum, all-reduced over the group, with the
bias added on rank 0 only so it is counted once. Packed layers (gate/up, q/k/v) hold
several projections in one weight and cut each checkpoint tensor twice: first which
projection (offset in the packed weight), then which rank (chunk of that projection). A
checkpoint that stores them packed already (Phi-3's qkv_proj and gate_up_proj) hands the whole
tensor without a shard id: the layer splits it into its projections first.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes
the full (unsharded) checkpoint tensor and copies this rank's part, converting dtype.

How the weight is stored and multiplied is the layer's `linear_method` (layers/quantization),
asked of the model's LinearMethodChooser in the constructor by the layer's prefix (its name in
the model), and kept for the layer's life.
"""

import torch
from torch import nn

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.layers.quantization import LinearMethod
from nanovllm.layers.quantization.chooser import LinearMethodChooser, choose_linear_method
from nanovllm.loader.weights import default_weight_loader


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor parallel size {denominator}")
    return numerator // denominator


def copy_chunk(dst: torch.Tensor, src: torch.Tensor, dim: int, index: int, num_chunks: int) -> None:
    """Copy chunk `index` of `num_chunks` equal chunks of `src` along `dim` into `dst`.

    `src` must be exactly `num_chunks` times `dst` along `dim` (and equal elsewhere), so a
    checkpoint that disagrees with the config fails instead of loading a wrong slice.
    """
    expected = list(dst.shape)
    expected[dim] *= num_chunks
    if list(src.shape) != expected:
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(src.shape)}")
    size = dst.shape[dim]
    dst.copy_(src.narrow(dim, index * size, size))


def _make_params(module: nn.Module, input_size: int, output_size: int, bias: bool,
                 linear_methods: LinearMethodChooser | None, prefix: str, batch_invariant: bool = False) -> None:
    """Give `module` its linear method and, through it, weight [output_size, input_size] and an
    optional bias, wired to its weight_loader."""
    module.linear_method: LinearMethod = choose_linear_method(linear_methods, module, prefix, input_size,
                                                              batch_invariant=batch_invariant)
    module.linear_method.create_weights(module, input_size, output_size, bias)


def load_packed(layer: nn.Module, param: nn.Parameter, loaded_weight: torch.Tensor, sizes: dict[object, int]) -> None:
    """A checkpoint tensor holding every projection of a packed layer, one after another along dim
    0 (`sizes`: each shard's unsharded rows, in order), loaded shard by shard."""
    if loaded_weight.shape[0] != sum(sizes.values()):
        raise ValueError(f"a packed tensor of {sum(sizes.values())} rows ({' + '.join(map(str, sizes.values()))}) "
                         f"expected, got {loaded_weight.shape[0]}")
    offset = 0
    for shard_id, size in sizes.items():
        layer.weight_loader(param, loaded_weight.narrow(0, offset, size), shard_id)
        offset += size


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight. `batch_invariant`: each row's output must not depend on
    the step's other rows, whatever the weight's format (a router: LinearMethodChooser.method_for)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 linear_methods: LinearMethodChooser | None = None, prefix: str = "", batch_invariant: bool = False):
        super().__init__()
        _make_params(self, input_size, output_size, bias, linear_methods, prefix, batch_invariant)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (the output dim) split across ranks; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, *, tp_group: TPGroup, bias: bool = False,
                 linear_methods: LinearMethodChooser | None = None, prefix: str = ""):
        super().__init__()
        self.tp_group = tp_group
        self.output_size_per_rank = divide(output_size, tp_group.world_size, "output_size")
        _make_params(self, input_size, self.output_size_per_rank, bias, linear_methods, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"unpacked parameter got shard {shard_id!r}")
        copy_chunk(param.data, loaded_weight, 0, self.tp_group.rank, self.tp_group.world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input packed in one weight (gate/up).

    Per rank the packed output is [proj 0's chunk | proj 1's chunk | ...]; shard_id is the
    projection's index in `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], *, tp_group: TPGroup, bias: bool = False,
                 linear_methods: LinearMethodChooser | None = None, prefix: str = ""):
        self.output_sizes = list(output_sizes)
        self.sizes_per_rank = [divide(s, tp_group.world_size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), tp_group=tp_group, bias=bias, linear_methods=linear_methods,
                         prefix=prefix)

    def output_slice(self, shard_id: object) -> tuple[int, int]:
        """(offset, size): the rows of this rank's packed weight that projection `shard_id` fills."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.sizes_per_rank):
            raise ValueError(f"packed parameter needs a shard index in 0..{len(self.sizes_per_rank) - 1}, got {shard_id!r}")
        return sum(self.sizes_per_rank[:shard_id]), self.sizes_per_rank[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            load_packed(self, param, loaded_weight, dict(enumerate(self.output_sizes)))
            return
        dst = param.data.narrow(0, *self.output_slice(shard_id))
        copy_chunk(dst, loaded_weight, 0, self.tp_group.rank, self.tp_group.world_size)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections packed in one column-parallel weight, split by heads.

    Each rank gets num_heads / tp query heads. When tp exceeds the number of KV heads, KV
    heads are replicated: each rank holds one KV head, shared by tp / num_kv_heads
    consecutive ranks (so rank r serves the query heads that use KV head r // replicas).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 *, tp_group: TPGroup, bias: bool = False, linear_methods: LinearMethodChooser | None = None,
                 prefix: str = ""):
        tp = tp_group.world_size
        self.head_dim = head_dim
        self.num_heads_total, self.num_kv_heads_total = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            if tp % num_kv_heads:
                raise ValueError(f"tensor parallel size {tp} is not a multiple of num_key_value_heads="
                                 f"{num_kv_heads}, so KV heads cannot be replicated evenly")
            self.num_kv_heads, self.num_kv_replicas = 1, tp // num_kv_heads
        else:
            self.num_kv_heads, self.num_kv_replicas = divide(num_kv_heads, tp, "num_key_value_heads"), 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        # The base class divides the output size by tp, so pass tp times the per-rank size:
        # with replicated KV heads the per-rank size is not the unsharded size / tp.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp, tp_group=tp_group, bias=bias,
                         linear_methods=linear_methods, prefix=prefix)

    def output_slice(self, shard_id: object) -> tuple[int, int]:
        """(offset, size): the rows of this rank's packed weight that projection `shard_id` fills."""
        slices = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in slices:
            raise ValueError(f"packed qkv parameter needs shard 'q', 'k' or 'v', got {shard_id!r}")
        return slices[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            load_packed(self, param, loaded_weight, {"q": self.num_heads_total * self.head_dim,
                                                     "k": self.num_kv_heads_total * self.head_dim,
                                                     "v": self.num_kv_heads_total * self.head_dim})
            return
        offset, size = self.output_slice(shard_id)
        if shard_id == "q":
            index, num_chunks = self.tp_group.rank, self.tp_group.world_size
        else:  # k and v: a KV head may be replicated over several ranks
            index = self.tp_group.rank // self.num_kv_replicas
            num_chunks = self.tp_group.world_size // self.num_kv_replicas
        copy_chunk(param.data.narrow(0, offset, size), loaded_weight, 0, index, num_chunks)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (the input dim) split across ranks; input is sharded.
    `reduce_results` False returns this rank's partial sum, for a caller that adds it to others
    before one all-reduce."""

    def __init__(self, input_size: int, output_size: int, *, tp_group: TPGroup, bias: bool = False,
                 linear_methods: LinearMethodChooser | None = None, prefix: str = "", reduce_results: bool = True):
        super().__init__()
        self.tp_group = tp_group
        self.reduce_results = reduce_results
        _make_params(self, divide(input_size, tp_group.world_size, "input_size"), output_size, bias, linear_methods,
                     prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is not sharded
            default_weight_loader(param, loaded_weight, shard_id)
            return
        if shard_id is not None:
            raise ValueError(f"unpacked parameter got shard {shard_id!r}")
        copy_chunk(param.data, loaded_weight, 1, self.tp_group.rank, self.tp_group.world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank holds the bias, but only rank 0 adds it: the all-reduce sums it once.
        y = self.linear_method.apply(self, x, self.bias if self.tp_group.is_first_rank else None)
        return self.tp_group.all_reduce(y) if self.reduce_results else y
