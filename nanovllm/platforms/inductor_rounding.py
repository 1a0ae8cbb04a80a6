"""An Inductor graph pass that keeps a compiled matmul rounding where eager PyTorch does.

Inductor rewrites `mm(a, b) + c` into `addmm(c, a, b)`, which adds `c` to the product inside
the GEMM, in fp32, and rounds once. In bf16 (or fp16), eager rounds the product to bf16 first
and then rounds the sum: the two differ by a unit in the last place on about a quarter of the
elements. Our residual adds (`o_proj(x) + residual` in the next norm) are exactly that
pattern wherever a linear is a plain `mm` rather than an opaque kernel (bf16 without the CPU
kernels), and a layer would then drift from eager on every call. The pass splits those
`addmm`s back into `mm` and an add, which Inductor fuses into the pointwise code after it,
rounding as eager does. A bias (`addmm` of a 1-D vector, as eager's own `linear` makes) and
fp32 (where the GEMM's sum rounds like eager's two steps) are left alone.
"""

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


class UnfuseReducedPrecisionAddmm(CustomGraphPass):
    """For `post_grad_custom_post_pass`: `addmm(c, a, b)` with a full 2-D `c` in bf16/fp16 ->
    `mm(a, b) + c`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.target is not aten.addmm.default or node.kwargs:  # alpha/beta other than 1
                continue
            addend, mat1, mat2 = node.args
            value = addend.meta.get("val") if isinstance(addend, torch.fx.Node) else None
            if value is None or value.dim() != 2 or value.dtype not in REDUCED_PRECISION:
                continue
            with graph.inserting_before(node):
                product = graph.call_function(aten.mm.default, (mat1, mat2))
                total = graph.call_function(aten.add.Tensor, (product, addend))
            product.meta = dict(node.meta)  # same shape, dtype and strides as the addmm's result
            # The mark Inductor gives each op that eager runs on its own (under
            # emulate_precision_casts): the sum is rounded to bf16 even where it is fused into
            # the code that reads it, as eager's add stores it rounded.
            total.meta = {**node.meta, "low_precision_pointwise_barrier": True}
            node.replace_all_uses_with(total)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        # Part of Inductor's cache key: a change to this file compiles afresh.
        return get_hash_for_files((__file__,))
