"""Compile the Triton kernels for an NVIDIA GPU without one: source -> TTIR -> TTGIR -> LLVM ->
PTX -> cubin (Triton's bundled ptxas), with the compile-time parameters the engine launches.

The interpreter tests check what the kernels compute; this checks that the compiler accepts
them (dtypes, tile shapes, shared memory against the target's per-block limit) for the target,
so the GPU path is not dead on arrival. Run without TRITON_INTERPRET. Prints one line per
kernel; exits non-zero on failure.

    python scripts/triton_compile_check.py [--arch 90]
"""

import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the interpreter does not compile")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.attention import triton as kernels  # noqa: E402
from nanovllm.kernels import triton_elementwise as elementwise  # noqa: E402

TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# (num_heads, num_kv_heads, head_dim, block_size, dtype): Qwen3-0.6B in bf16 and in fp32 (the
# parity tests' precision), a head dim of 64, and the tiny fp32 test models (GQA 3, head dim 24
# that is not a power of two).
SHAPES = [(16, 8, 128, 16, torch.bfloat16), (16, 8, 128, 16, torch.float32), (8, 4, 64, 16, torch.bfloat16),
          (8, 4, 64, 16, torch.float32), (9, 3, 24, 16, torch.float32)]
# Shared memory one block may use (dynamic, opt-in), by compute capability x10 (CUDA's tables).
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def compile_kernel(fn, arg_types: dict, constexprs: dict, arch: int):
    missing = set(fn.arg_names) - set(arg_types) - set(constexprs)
    assert not missing, f"no type given for {sorted(missing)}"
    signature = {name: "constexpr" if name in constexprs else arg_types[name] for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))


def attention_jobs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    """(label, kernel, argument types, compile-time parameters) of the attention kernels at one shape."""
    ptr = "*" + TRITON_DTYPES[dtype]
    shape = f"heads {num_heads}/{num_kv_heads} d{head_dim} {TRITON_DTYPES[dtype]}"
    store_types = {name: ptr for name in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    store_types.update(slot_mapping_ptr="*i64", **{name: "i32" for name in (
        "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h",
        "cache_stride_block", "cache_stride_tok", "cache_stride_head")})
    attention_types = {name: ptr for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "o_ptr")}
    attention_types.update(cu_seqlens_q_ptr="*i32", context_lens_ptr="*i32", block_tables_ptr="*i32",
                           part_acc_ptr="*fp32", part_stats_ptr="*fp32",
                           scale_log2="fp32", window="i32", softcap_log2="fp32", num_splits="i32", **{name: "i32" for name in (
                               "q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h", "block_tables_stride",
                               "cache_stride_block", "cache_stride_tok", "cache_stride_head")})
    yield (f"store_kvcache {shape}", kernels._store_kvcache_kernel, store_types,
           kernels.store_kvcache_config(num_kv_heads, head_dim, block_size))
    for step, max_query_len, splits, window, softcap in (("decode", 1, 1, 0, 0.0), ("decode, split", 1, 8, 0, 0.0),
                                                         ("prefill", 2, 1, 0, 0.0),
                                                         ("prefill, window, softcap", 2, 1, 4096, 50.0)):
        config = kernels.paged_attention_config(num_heads, num_kv_heads, head_dim, block_size, max_query_len,
                                                dtype, splits, window, softcap)
        yield f"paged_attention[{step}] {shape}", kernels._paged_attention_kernel, attention_types, config
    merge_types = dict(part_acc_ptr="*fp32", part_stats_ptr="*fp32", o_ptr=ptr, o_stride_t="i32", o_stride_h="i32",
                       num_splits="i32")
    yield (f"merge_kv_splits {shape}", kernels._merge_kv_splits_kernel, merge_types,
           dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_S=kernels.MAX_KV_SPLITS,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim))))


def elementwise_jobs(dtype: torch.dtype):
    """The elementwise kernels at Qwen3-0.6B's sizes (hidden 1024, head dim 128, 16/8 heads)."""
    ptr = "*" + TRITON_DTYPES[dtype]
    norm_types = dict(x_ptr=ptr, residual_ptr=ptr, weight_ptr=ptr, out_ptr=ptr, summed_ptr=ptr, x_stride_t="i32",
                      x_stride_h="i32", residual_stride="i32", n_cols="i32", eps="fp32")
    rope_types = dict(q_ptr=ptr, k_ptr=ptr, q_out_ptr=ptr, k_out_ptr=ptr, positions_ptr="*i64",
                      cos_sin_ptr="*fp32", q_stride="i32", k_stride="i32")
    yield (f"rms_norm {TRITON_DTYPES[dtype]}", elementwise._rms_norm_kernel, norm_types,
           dict(NUM_HEADS=1, HAS_RESIDUAL=True, BLOCK=1024))
    yield (f"silu_and_mul {TRITON_DTYPES[dtype]}", elementwise._silu_and_mul_kernel,
           dict(x_ptr=ptr, out_ptr=ptr, x_stride="i32", n_cols="i32"), dict(BLOCK=elementwise.SILU_BLOCK))
    yield (f"rotary_embedding {TRITON_DTYPES[dtype]}", elementwise._rope_kernel, rope_types,
           dict(NUM_Q_HEADS=16, NUM_K_HEADS=8, HEAD_DIM=128, BLOCK=64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    arch = parser.parse_args().arch
    limit = SHARED_MEMORY_LIMIT.get(arch)
    jobs = [job for shape in SHAPES for job in attention_jobs(*shape)]
    jobs += [job for dtype in (torch.bfloat16, torch.float32) for job in elementwise_jobs(dtype)]
    failed = []
    for name, fn, types, constexprs in jobs:
        start = time.perf_counter()
        label = f"sm_{arch} {name}"
        try:
            compiled = compile_kernel(fn, types, constexprs, arch)
        except Exception as e:  # report every kernel, then fail
            print(f"{label}: FAILED to compile: {type(e).__name__}: {e}")
            failed.append(label)
            continue
        shared = compiled.metadata.shared
        over = limit is not None and shared > limit
        print(f"{label}: {len(compiled.asm['cubin'])} B cubin, {shared} B shared memory"
              f"{f' OVER the {limit} B limit' if over else ''}, {time.perf_counter() - start:.1f} s")
        if over:
            failed.append(label)
    if limit is None:
        print(f"no shared-memory limit known for sm_{arch}: not compared")
    if failed:
        sys.exit(f"{len(failed)} kernel(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
