"""Linear methods: how a linear layer's weight is stored and multiplied, one module per weight
format or kernel. A layer owns its shape, sharding and weight loader and hands the rest to the
method object it holds (see base.LinearMethod)."""

from nanovllm.layers.quantization.base import LinearMethod
from nanovllm.layers.quantization.unquantized import UnquantizedLinearMethod

__all__ = ["LinearMethod", "UnquantizedLinearMethod"]
