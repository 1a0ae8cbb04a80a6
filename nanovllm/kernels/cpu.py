"""The compiled CPU kernels (cpu/, a .cpp file per op family): built on first use for one
instruction set, with their Python faces.

Variants (cpu/simd.h): `amx` (`avx512` with AMX-TILE and AMX-INT8: the quantized kernels' many-row
path on tiles), `avx512` (AVX512F/BW/VL with AVX512-BF16 and VNNI), `avx2` (AVX2 + FMA + F16C) and
`none` (plain C++). The best one this CPU executes is built, or the one NANOVLLM_CPU_ISA names,
so that a machine tests every variant it can run; asking for one it cannot run is an error.
The engine switches onto the kernels (linear, norm, SiLU, sampling) only on `amx`, `avx512` and `avx2`
(`has_simd_kernels()`); `none` keeps plain PyTorch except the paged attention, whose portable
path is the only one over the CPU cache layout.

The extension is compiled through torch's cpp_extension machinery and cached in torch's
extensions directory under a name that hashes every source and header with its path, the
torch version and the variant's flags, so an edit to any of them, an upgrade or another
variant builds afresh and a warm cache loads in well under a second. The paths of the sources
and of the Python environment (sys.prefix and torch's headers) are in the name because the
build remembers both: two checkouts of the same sources, or two environments using one checkout,
sharing one build would rebuild it (tens of seconds) at every switch between them. Without a working
compiler `available()` is False and callers fall back to plain PyTorch.

Ops (namespace `nanovllm_cpu`, each with a fake implementation so `torch.compile` can trace
through them): `linear` (the packed kernel for a few rows, oneDNN otherwise), `linear_packed`,
`onednn_pack` / `onednn_release` (oneDNN's own copy of a weight, named by a handle),
`gguf_linear` / `gguf_linear_parts` / `gguf_dequantize` / `gguf_repack` (weights in GGUF's block formats),
`gguf_moe` / `packed_moe` (a mixture of experts' experts in blocks / packed bf16),
`store_kv`, `paged_attention`, `sample_rows`, `mask_disallowed`, the elementwise
`silu_and_mul`, `gelu_tanh_and_mul`, `rms_norm`, `add_rms_norm`, `decoder_layers` (a run of decoder layers as one call
over the others), `isa` and `amx_tiles_granted`; see cpu/registration.cpp.
"""

import contextlib
import ctypes
import fcntl
import functools
import glob
import hashlib
import logging
import math
import mmap
import os
import platform
import sys
import weakref

import torch
import torch.nn.functional as F

from nanovllm.startup import phase as startup_phase

logger = logging.getLogger(__name__)

_SOURCE_DIR = os.path.join(os.path.dirname(__file__), "cpu")
# The .cpp files are compiled; the build key hashes the headers with them, as an edit to a
# header must rebuild too. Sorted: the key must not depend on the order a directory lists in.
_SOURCES = sorted(glob.glob(os.path.join(_SOURCE_DIR, "*.cpp")))
_HEADERS = sorted(glob.glob(os.path.join(_SOURCE_DIR, "*.h")))
# What the compiler is given: two translation units that include the sources (cpu/units/).
# Each unit parses torch's headers again, and two units are as many as two cores build at
# once (benchmarks/RESULTS.md, 2026-12-03: the build with a unit per file and with these).
_UNITS = sorted(glob.glob(os.path.join(_SOURCE_DIR, "units", "*.cpp")))
_BUILD_VERSION = b"3"  # bump when the build flags change

ISA_ENV = "NANOVLLM_CPU_ISA"
# Each variant: the /proc/cpuinfo flags a CPU needs to run it, and the compiler flags that
# build it (x86 only: elsewhere only `none` exists). Best first.
_AVX512 = (("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"),
           ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma",
            "-mf16c"])
ISAS = {
    "amx": ((*_AVX512[0], "amx_tile", "amx_int8"), [*_AVX512[1], "-mamx-tile", "-mamx-int8"]),
    "avx512": _AVX512,
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    "none": ((), []),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable_isas() -> list[str]:
    """The variants this CPU executes, best first."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = _cpu_flags()
    return [isa for isa, (needs, _) in ISAS.items() if isa == "none" or (x86 and flags.issuperset(needs))]


@functools.cache
def isa() -> str:
    """The variant this process builds: NANOVLLM_CPU_ISA if set, else the best this CPU runs."""
    runnable = runnable_isas()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return runnable[0]
    if forced not in ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r} is not a kernel variant; use one of {', '.join(ISAS)}")
    if forced not in runnable:
        raise ValueError(f"{ISA_ENV}={forced!r}: this CPU cannot execute it; it runs {', '.join(runnable)}")
    return forced


def build_name(variant: str) -> str:
    """The extension's name: the variant and a hash of everything its build depends on."""
    fingerprint = [_BUILD_VERSION, torch.__version__.encode(), variant.encode(), " ".join(ISAS[variant][1]).encode(),
                   os.path.realpath(sys.prefix).encode(), os.path.realpath(os.path.dirname(torch.__file__)).encode()]
    for path in _SOURCES + _HEADERS + _UNITS:
        with open(path, "rb") as f:
            fingerprint += [f.read(), os.path.realpath(path).encode()]
    key = hashlib.sha256(b"\0".join(fingerprint)).hexdigest()[:16]
    return f"nanovllm_cpu_{variant}_{key}"


def build_directory(name: str) -> str:
    """Where the build called `name` lives: in torch's extensions directory (TORCH_EXTENSIONS_DIR
    or its default), the name alone telling builds apart."""
    from torch.utils.cpp_extension import get_default_build_root
    return os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), name)


@contextlib.contextmanager
def _held_build_directory(name: str):
    """The build's directory, held for this process alone while torch builds or loads in it.

    torch guards the directory with a `lock` file that a killed build leaves behind, and every
    later load waits on it forever. Holding an flock, which the OS drops with its process, means
    a `lock` seen here belongs to no live build and can go.
    """
    directory = build_directory(name)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "build.flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, "lock"))
        yield directory


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels; False, with a warning, if that fails."""
    variant = isa()
    flags = ISAS[variant][1]
    try:
        from torch.utils.cpp_extension import load
        name = build_name(variant)
        # No -fopenmp: the kernels' threads are their own pool's (cpu/thread_pool.h), not OpenMP's.
        with startup_phase(f"CPU kernels ({variant}: build or load)"), _held_build_directory(name) as directory:
            load(name=name, sources=_UNITS, extra_cflags=["-O3", *flags], is_python_module=False,
                 build_directory=directory, verbose=False)
    except Exception as e:  # no compiler, no ninja, an unsupported platform...
        logger.warning("nano-vllm CPU kernels could not be built (%s); using plain PyTorch, which is slower", e)
        return False
    built = torch.ops.nanovllm_cpu.isa()
    if built != variant:  # the flags did not enable what the variant needs
        raise RuntimeError(f"the CPU kernels built for {variant!r} report {built!r}; the compiler ignored {flags}")
    if variant == "amx" and not torch.ops.nanovllm_cpu.amx_tiles_granted():
        logger.warning("the kernel refused this process the AMX tiles (arch_prctl); quantized prefill runs on "
                       "the slower AVX-512 tiles (benchmarks/RESULTS.md)")
    _register_fakes()
    logger.info("CPU kernels: %s (this CPU runs %s)", variant, ", ".join(runnable_isas()))
    return True


def _register_fakes() -> None:
    @torch.library.register_fake("nanovllm_cpu::linear")
    def _(x, weight, packed, bias, max_packed_rows, onednn):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("nanovllm_cpu::linear_packed")
    def _(x, packed, bias, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("nanovllm_cpu::gguf_linear")
    def _(x, blocks, type, bias, max_streaming_rows, activation_bits=16):
        return x.new_empty(*x.shape[:-1], blocks.shape[0])

    @torch.library.register_fake("nanovllm_cpu::gguf_linear_parts")
    def _(x, blocks, parts, out_features, bias, max_streaming_rows, activation_bits=16):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("nanovllm_cpu::gguf_moe")
    def _(x, topk_ids, topk_weights, w13, w13_type, w2, w2_type, intermediate, activation, max_streaming_rows,
          w13_bits, w2_bits):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("nanovllm_cpu::packed_moe")
    def _(x, topk_ids, topk_weights, w13, w2, intermediate, activation):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("nanovllm_cpu::gguf_dequantize")
    def _(blocks, type, in_features):
        return blocks.new_empty(blocks.shape[0], in_features, dtype=torch.float32)

    @torch.library.register_fake("nanovllm_cpu::store_kv")
    def _(k, v, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("nanovllm_cpu::paged_attention")
    def _(out, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window, softcap):
        return None

    @torch.library.register_fake("nanovllm_cpu::silu_and_mul")
    def _(x):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @torch.library.register_fake("nanovllm_cpu::gelu_tanh_and_mul")
    def _(x):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @torch.library.register_fake("nanovllm_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("nanovllm_cpu::decoder_layers")
    def _(hidden, residual, positions, weights, settings, eps, scale, softcap, k_caches, v_caches, slot_mapping,
          cu_seqlens_q, context_lens, block_tables):
        return torch.empty_like(hidden), torch.empty_like(hidden)

    @torch.library.register_fake("nanovllm_cpu::add_rms_norm")
    def _(x, residual, weight, eps):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))


@functools.cache
def has_simd_kernels() -> bool:
    """Whether the engine switches onto the kernels here (the packed linear, the sampler and the
    elementwise ops): an `amx`, `avx512` or `avx2` build."""
    return available() and isa() != "none"


def packed_max_rows() -> int:
    """Rows up to which the packed kernel beats oneDNN (on its own packed weights). It streams
    the weights at memory speed for a few rows; on AVX512-BF16 without AMX it stays ahead of
    oneDNN's GEMM to about 100 rows, with AMX tiles oneDNN's GEMM is several times faster than
    any AVX-512 kernel once there are rows enough to fill them, and on AVX2 oneDNN's fp32 GEMM,
    which reads twice the bytes, catches up at 32-64 rows (measurements in benchmarks/RESULTS.md)."""
    if isa() in ("amx", "avx512"):
        return 16 if "amx_bf16" in _cpu_flags() else 96
    return 32


def packed_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
    n, k = weight.shape
    return -(-n // 16), -(-k // 2), 16, 2


def pack_linear_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] bf16 -> [ceil(N/16), ceil(K/2), 16, 2]: two k-steps of 16 output columns per 64 bytes,
    into `out` (of packed_shape) when given.

    N and K are zero-padded up to multiples of 16 and 2; the kernel never reads x past K.
    """
    n, k = weight.shape
    panels, pairs, _, _ = packed_shape(weight)
    padded = F.pad(weight, (0, k % 2, 0, -n % 16)).view(panels, 16, pairs, 2).transpose(1, 2)
    return padded.contiguous() if out is None else out.copy_(padded)


HUGE_PAGE_BYTES = 2 << 20


def empty_mapped(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool) -> torch.Tensor:
    """A CPU tensor in fresh private memory: a page is only allocated (and zeroed by the OS,
    so it never holds another allocation's garbage) when first written. With `huge_pages` the
    memory is advised for transparent huge pages: for data the kernels stream through (the
    packed weights: hardware prefetchers stop at page boundaries), 2 MB pages save a page walk
    every 4 KB (figures in benchmarks/RESULTS.md).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # mmap cannot map nothing
        return torch.empty(shape, dtype=dtype)
    huge_pages = huge_pages and hasattr(mmap, "MADV_HUGEPAGE")  # Linux
    # A huge page backs only a 2 MB-aligned range: start the tensor at one (the slack before it
    # is never written, so never allocated).
    slack = HUGE_PAGE_BYTES if huge_pages else 0
    buffer = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    mapped = torch.frombuffer(buffer, dtype=torch.uint8)  # the tensor keeps the buffer alive
    start = -mapped.data_ptr() % slack if huge_pages else 0
    return mapped[start:start + nbytes].view(dtype).view(shape)


def _release_freed_heap() -> None:
    """Hand glibc's free heap pages back to the kernel (the platform turns automatic trimming
    off for the steps' sake). No-op off glibc."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim(0)


def move_to_huge_pages(weights: list[torch.Tensor]) -> None:
    """Move each weight's data (a parameter's, contiguous) into one arena in transparent huge
    pages, 64-byte aligned: for weights a decode step streams, which in 4 KB pages read far
    slower (a page walk every 4 KB, and the hardware prefetchers stop at every page's end;
    figures in benchmarks/RESULTS.md). Weights that share their data (a tied embedding and LM
    head) move together, once. Each old copy's memory goes back to the kernel as soon as it is
    moved, so the process never holds a weight twice over (most are heap allocations, which
    freeing alone would keep resident)."""
    shared: dict[int, list[torch.Tensor]] = {}
    for weight in weights:
        shared.setdefault(weight.data_ptr(), []).append(weight)
    if not shared:
        return
    spans = [-(-same[0].nbytes // 64) * 64 for same in shared.values()]
    arena = empty_mapped((sum(spans),), torch.uint8, huge_pages=True)
    offset = 0
    for same, span in zip(shared.values(), spans):
        first = same[0].data
        moved = arena[offset:offset + first.nbytes].view(first.dtype).view(first.shape).copy_(first)
        for weight in same:
            weight.data = moved
        del first
        _release_freed_heap()
        offset += span


def onednn_pack(weight: torch.Tensor, owner: object) -> torch.Tensor:
    """oneDNN's reordered copy of a bf16 [N, K] weight, for the GEMM `linear` runs on many rows;
    returns its handle, a one-element int64 tensor. The copy is released when `owner` is
    garbage-collected."""
    handle = torch.ops.nanovllm_cpu.onednn_pack(weight)
    weakref.finalize(owner, torch.ops.nanovllm_cpu.onednn_release, handle)
    return handle


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The packed kernel alone, whatever the number of rows (for tests)."""
    return torch.ops.nanovllm_cpu.linear_packed(x, packed, bias, out_features)
