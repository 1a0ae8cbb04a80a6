"""torch.compile on CPU, the CPU's answer to CUDA graphs: decoder layers compiled a few at a
time into one graph that serves every step (prefill, decode and mixed), rounding as eager does,
compiled ahead of time (Dynamo's `aot_compile`) and kept on disk, so that a later start loads
the graph instead of tracing the layers again.

A compiled forward is a plain function of (module, *tensors): the module's parameters, buffers
and KV cache are read at each call, so one compiled function serves every group of layers of
the same kind, in every engine of the process. It runs without Dynamo's frame hook, cache
lookup or guards in between: a step cannot recompile, and no process-wide guard setting is
needed that would also reach the user's own compiled code. What the guards would have checked
is the key of the compiled function instead (`graph_key`); the graph still asserts its
inputs' static sizes and strides.
"""

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from nanovllm.cache_paths import user_cache_dir
from nanovllm.kernels import cpu as cpu_kernels
from nanovllm.layers.attention import Attention
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.decoder_layers import run_in_turn
from nanovllm.platforms.inductor_rounding import UnfuseReducedPrecisionAddmm

logger = logging.getLogger(__name__)

# One object for every compile: the pass is part of Inductor's cache key through its uuid.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "post_grad_custom_post_pass": UnfuseReducedPrecisionAddmm()}

# Decoder layers per compiled call. Each call into a compiled graph costs some microseconds of
# Python, once per call and step; two layers a call halve that and divide every usual layer
# count, while more save less and compile longer (figures in benchmarks/RESULTS.md).
LAYERS_PER_GRAPH = 2

# Saved graphs kept at most (every change of nano-vllm's sources or of a model's kind saves new
# ones): past it the least recently used go, a load counting as a use.
MAX_SAVED_GRAPHS = 32

# The compiled forwards of this process by graph_key: engines of the same model share them.
_compiled: dict[str, Callable] = {}


def compile_with_dynamic_tokens(module: nn.Module) -> Callable:
    """`module` called through its compiled graph: a function of the module's call's arguments,
    with the leading (token) dim of its tensor arguments dynamic and everything else static except
    the KV cache's size. The graph is made at the first call, for that call's kind of arguments
    (or loaded from the cache directory, where it is then saved), and serves every later call of
    that kind.

    The token dim is marked unbacked, a size the compiler may not specialise on (not even 1,
    which it otherwise gives a graph of its own), so one graph serves every step; static
    shapes elsewhere make the key (and the graph) exact. The KV cache's dims are dynamic: the
    number of blocks depends on the memory free at start-up, and the opaque attention op is
    all that reads the cache.

    emulate_precision_casts: the fused kernels round to bf16 wherever the eager code does (after
    the residual add, the norm, RoPE, SiLU). Without it Inductor keeps fused intermediates in
    fp32 and each layer drifts from eager by a bf16 ulp or so, which over a model's layers can
    turn a near-tied greedy token the other way. With it, and with matmuls rounded before the
    residual add as eager rounds them (see inductor_rounding), a layer's output equals eager's
    up to the order of the norm's sum (see test_compiled_layers_round_like_eager)."""
    compiled: Callable | None = None

    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = compiled_forward(module, args)
        return compiled(module, *args)

    return call


def compiled_forward(module: nn.Module, args: tuple[torch.Tensor, ...]) -> Callable:
    """type(module).forward compiled for `module`'s kind and `args`' kind: from this process,
    else from the cache directory, else compiled now and saved there."""
    key = graph_key(module, args)
    if key in _compiled:
        return _compiled[key]
    forward = type(module).forward
    path = Path(user_cache_dir("compiled-graphs")) / f"{key}.bin"
    start = time.perf_counter()
    compiled = _load(path, forward.__globals__)
    if compiled is None:
        for arg in args:
            torch._dynamo.decorators.mark_unbacked(arg, 0)
        for cache in _kv_caches(module):
            for dim in range(cache.dim()):
                torch._dynamo.maybe_mark_dynamic(cache, dim)
        # Python floats (a norm's eps, a RoPE setting) are constants, as the key takes them; left
        # symbolic, one that must specialise restarts the trace, which aot_compile cannot do.
        with torch._dynamo.config.patch(specialize_float=True):
            compiled = torch.compile(forward, fullgraph=True, options=COMPILE_OPTIONS).aot_compile(((module, *args), {}))
        _save(compiled, path)
        logger.debug("compiled %s in %.1f s (saved as %s)", type(module).__name__, time.perf_counter() - start, path)
    else:
        logger.debug("loaded the compiled %s from %s in %.1f s", type(module).__name__, path,
                     time.perf_counter() - start)
    compiled.disable_guard_check()  # the key stands for the guards
    _compiled[key] = compiled
    return compiled


def graph_key(module: nn.Module, args: tuple[torch.Tensor, ...]) -> str:
    """A digest of everything the graph depends on: the code (torch's version and this package's
    sources), the kernel variant and thread count (Inductor's loops are built for it), and each
    submodule's kind, settings and tensors, the linear methods' settings included; the
    arguments' dtypes and their shapes and strides past the token dim. The KV cache counts by
    its dtype and rank only (its dims are dynamic)."""
    parts = [torch.__version__, _package_digest(), cpu_kernels.isa() if cpu_kernels.available() else "none",
             str(torch.get_num_threads()), COMPILE_OPTIONS["post_grad_custom_post_pass"].uuid().hex()]
    caches = {id(cache) for cache in _kv_caches(module)}
    for name, sub in module.named_modules():
        parts.append(f"{name}:{type(sub).__qualname__}")
        if isinstance(sub, CustomOp):
            parts.append(f"{name}:{sub.forward_name}")
        owners = [owner for owner in (sub, getattr(sub, "linear_method", None)) if owner is not None]
        for attr, value in (item for owner in owners for item in sorted(vars(owner).items())):
            if isinstance(value, torch.Tensor):
                parts.append(f"{attr}={value.dtype}[{value.dim()}]" if id(value) in caches
                             else f"{attr}={_tensor_kind(value)}")
            elif isinstance(value, (bool, int, float, str, tuple, type(None))):
                parts.append(f"{attr}={value!r}")
    parts += [f"{name}={_tensor_kind(t)}" for name, t in module.named_parameters()]
    parts += [f"{name}={_tensor_kind(t)}" for name, t in module.named_buffers()]
    parts += [f"arg={a.dtype}{tuple(a.shape[1:])}{a.stride()[1:]}" for a in args]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _tensor_kind(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype}{tuple(tensor.shape)}{tensor.stride()}{tensor.device}"


@functools.cache
def _package_digest() -> str:
    """A digest of this package's Python sources: any edit may change a traced graph."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parents[1].rglob("*.py")):  # nanovllm/
        digest.update(str(path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _kv_caches(module: nn.Module) -> list[torch.Tensor]:
    return [cache for sub in module.modules() if isinstance(sub, Attention) for cache in (sub.k_cache, sub.v_cache)]


def _load(path: Path, f_globals: dict) -> Callable | None:
    if not path.exists():
        return None
    try:
        with open(path, "rb") as file:
            compiled = torch.compiler.load_compiled_function(file, f_globals=f_globals)
    except Exception as e:  # a damaged or stale file must not stop the engine: compile afresh
        logger.warning("ignoring the compiled graph in %s (%s); compiling it again", path, e)
        return None
    try:
        os.utime(path)  # used now: the pruning keeps it
    except OSError:
        pass
    return compiled


def _save(compiled: Callable, path: Path) -> None:
    try:
        os.makedirs(path.parent, exist_ok=True)
        compiled.save_compiled_function(str(path))  # written to a temporary file, then renamed
        prune_saved_graphs(path.parent)
    except OSError as e:  # a read-only home or a full disk: the next start compiles again
        logger.warning("could not save the compiled graph to %s (%s)", path, e)


def prune_saved_graphs(directory: Path, keep: int = MAX_SAVED_GRAPHS) -> None:
    """Delete all but the `keep` most recently used graph files in `directory`."""
    used = []
    for file in directory.glob("*.bin"):
        try:
            used.append((file.stat().st_mtime, file))
        except FileNotFoundError:  # pruned meanwhile by another process
            pass
    for _, file in sorted(used, reverse=True)[keep:]:
        file.unlink(missing_ok=True)


class LayerGroup(nn.Module):
    """Consecutive decoder layers as one call, (positions, hidden, residual) -> (hidden, residual):
    the unit compiled on CPU. It only holds the model's layers for the compiler: it is not part of
    the model."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor):
        return run_in_turn(self.layers, positions, hidden, residual)


class CompiledDecoderLayers:
    """Runs decoder layers (called in turn as layer(positions, hidden, residual)) as compiled
    groups of LAYERS_PER_GRAPH of them, compiled (or loaded) at the first call.

    Groups of layers, not the whole model: every group of the same kind shares one compiled
    graph (parameters and cache are its inputs), so a model's layers compile once (a last,
    shorter group, or layers of another weight type, add a graph); the whole model as one graph
    compiles many times longer. Attention is one opaque op and the linear op picks its kernel by
    row count at run time, so one graph serves prefill, decode and mixed steps alike."""

    def __init__(self, layers: list[nn.Module]):
        self.groups = [LayerGroup(layers[i:i + LAYERS_PER_GRAPH]) for i in range(0, len(layers), LAYERS_PER_GRAPH)]
        self.calls = [compile_with_dynamic_tokens(group) for group in self.groups]

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor):
        for call in self.calls:
            hidden, residual = call(positions, hidden, residual)
        return hidden, residual
