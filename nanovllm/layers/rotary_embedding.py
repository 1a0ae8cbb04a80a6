"""Rotary position embeddings (NeoX / rotate-half style, as HF Llama and Qwen use).

Owns reading RoPE settings from an HF config (both the transformers 5.x `rope_parameters`
form and the 4.x `rope_theta` + `rope_scaling` form), the inverse frequencies of each
supported scaling type, and a precomputed fp32 cos/sin cache indexed by position. A partial
rotary embedding (`partial_rotary_factor` < 1, Phi-4-mini) rotates the first rotary_dim dims of
each head and passes the rest through. On CUDA (Triton) one kernel rotates q and k.

LongRoPE (Phi-3) scales the frequencies by its short factors up to the original context and by
its long ones past it. Transformers switches every position of a sequence to the long factors
once the sequence outgrows the original context (its cached keys keep the short ones); here each
position takes the factors of its own range, the same whatever the sequence's length or batch,
which equals transformers for every sequence within the original context.
"""

import math

import torch

from nanovllm.layers.custom_op import CustomOp

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters_from_config(config, layer_type: str | None = None) -> dict:
    """One flat dict with `rope_type`, `rope_theta` and the scaling keys, from either config form;
    where the config gives parameters per kind of layer (Gemma 3's `rope_parameters` keyed by
    "full_attention" and "sliding_attention"), those of `layer_type`."""
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rope_parameters.get(layer_type), dict):
        rope_parameters = rope_parameters[layer_type]
    params = {**(getattr(config, "rope_scaling", None) or {}), **rope_parameters}
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params["rope_theta"] = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    base, old_len = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim index that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp).to(inv_freq.device)
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, attention_factor


def _longrope_inv_freq(inv_freq: torch.Tensor, p: dict, max_position: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE: the short and the long factors' inverse frequencies, and the cos/sin scale
    (sqrt(1 + log(factor) / log(original context)) unless the config gives it)."""
    old_len = p["original_max_position_embeddings"]
    short, long = (torch.tensor(p[key], dtype=torch.float32) for key in ("short_factor", "long_factor"))
    if short.shape != inv_freq.shape or long.shape != inv_freq.shape:
        raise ValueError(f"longrope needs {inv_freq.numel()} short and long factors (one per rotated pair), "
                         f"got {short.numel()} and {long.numel()}")
    factor = p.get("factor") or max_position / old_len
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return inv_freq / short, inv_freq / long, attention_factor


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    freqs = torch.outer(positions.float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(CustomOp):
    """Rotates the first `rotary_dim` dims of each head by the cos|sin row of each position
    (`cos_sin_cache` [max_position, rotary_dim], fp32)."""

    def __init__(self, head_dim: int, cos_sin_cache: torch.Tensor):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = cos_sin_cache.shape[1]
        # Derived from the config, never loaded: kept out of the state dict. fp32 on purpose:
        # bf16 cannot resolve the angles of large positions.
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads = x.float().view(x.shape[0], -1, self.head_dim)
        rotary, passed = heads.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        x1, x2 = rotary.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed], dim=-1)
        return rotated.to(x.dtype).view(x.shape)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T], q [T, H*D], k [T, KVH*D] -> rotated (q, k), new tensors of the same shapes."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward_cuda(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.rotary_dim != self.head_dim:  # the Triton kernel rotates whole heads
            return self.forward_native(positions, q, k)
        from nanovllm.kernels import triton_elementwise
        return triton_elementwise.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)


def get_rope(head_dim: int, max_position: int, rope_parameters: dict) -> RotaryEmbedding:
    """Build the rotary embedding for `rope_parameters` (see `rope_parameters_from_config`)."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    # Rotated dims: an even number, as transformers rounds them.
    dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0)) // 2 * 2
    if not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor={rope_parameters['partial_rotary_factor']} leaves {dim} of "
                         f"head_dim={head_dim} dims to rotate")
    theta = rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    positions = torch.arange(max_position)
    attention_scale = 1.0
    if rope_type == "longrope":
        short, long, attention_scale = _longrope_inv_freq(inv_freq, rope_parameters, max_position)
        within = positions < rope_parameters["original_max_position_embeddings"]
        cache = torch.cat([_cos_sin(positions[within], short), _cos_sin(positions[~within], long)])
        return RotaryEmbedding(head_dim, cache * attention_scale)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_parameters["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
    elif rope_type == "yarn":
        inv_freq, attention_scale = _yarn_inv_freq(inv_freq, dim, rope_parameters, max_position)
    return RotaryEmbedding(head_dim, _cos_sin(positions, inv_freq) * attention_scale)
