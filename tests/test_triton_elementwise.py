"""The CUDA platform's Triton kernels for RMSNorm (with the residual add), the gated SiLU and
rotary embedding (each op's forward_cuda) against its native forward, on strided inputs as the model
hands them over, in fp32 (and bf16 on CUDA); and a whole model built for CUDA gives the native logits.
Without CUDA the kernels run on CPU tensors under Triton's interpreter."""

import pytest
import torch

from conftest import make_tiny_config, triton_skip_reason

if triton_skip_reason():
    pytest.skip(triton_skip_reason(), allow_module_level=True)

from nanovllm.attention.base import forward_context  # noqa: E402
from nanovllm.attention.torch_native import TorchNativeBackend  # noqa: E402
from nanovllm.distributed.parallel_state import SINGLE  # noqa: E402
from nanovllm.platforms.gpu_memory import warmup_batch  # noqa: E402
from nanovllm.layers.activation import SiluAndMul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary_embedding import get_rope  # noqa: E402
from nanovllm.models.registry import get_model_class  # noqa: E402
from nanovllm.layers.build_context import built_for  # noqa: E402
from nanovllm.layers.custom_op import CustomOp  # noqa: E402
from nanovllm.platforms.cuda import CUDAPlatform  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter computes bf16 wrongly (NaNs): bf16 only compiled, on CUDA.
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # a rounding step apart at most
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    norm = RMSNorm(96, eps=1e-6).to(DEVICE)
    norm.weight.data = torch.randn(96, device=DEVICE).to(dtype)
    fused = norm.forward_cuda
    wide = torch.randn(7, 200, device=DEVICE).to(dtype)
    x = wide[:, 13:109]  # rows strided, as a slice of a wider output
    residual = torch.randn(7, 96, device=DEVICE).to(dtype)
    _close(fused(x), norm(x), dtype)
    out, summed = fused(x, residual)
    ref_out, ref_summed = norm(x, residual)
    assert torch.equal(summed, ref_summed)
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_rms_norm_reads_q_in_place(dtype):
    norm = RMSNorm(24).to(DEVICE)
    norm.weight.data = torch.randn(24, device=DEVICE).to(dtype)
    qkv = torch.randn(5, 4 * 24 + 2 * 2 * 24, device=DEVICE).to(dtype)
    q = qkv[:, :4 * 24].unflatten(-1, (-1, 24))  # [T, H, D], strided by the qkv row
    _close(norm.forward_cuda(q), norm(q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    act = SiluAndMul()
    x = torch.randn(6, 2 * 1500, device=DEVICE).to(dtype)  # two column blocks, the second partial
    _close(act.forward_cuda(x), act(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_of_strided_q_and_k(dtype):
    rope = get_rope(24, 256, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    qkv = torch.randn(9, (4 + 2 + 2) * 24, device=DEVICE).to(dtype)
    q, k = qkv[:, :96], qkv[:, 96:144]
    positions = torch.tensor([0, 1, 5, 17, 100, 200, 255, 3, 3], device=DEVICE)
    ref_q, ref_k = rope(positions, q, k)
    out_q, out_k = rope.forward_cuda(positions, q, k)
    _close(out_q, ref_q, dtype)
    _close(out_k, ref_k, dtype)


def test_a_model_built_for_cuda_gives_the_native_logits():
    """The same weights built natively and for the CUDA platform (every elementwise op on its
    Triton forward): the same logits."""
    config = make_tiny_config("Qwen3ForCausalLM", num_hidden_layers=2)
    torch.manual_seed(0)
    native = get_model_class(config)(config, SINGLE).to(DEVICE).eval()
    for p in native.parameters():
        p.data.normal_(0, 0.2)
    with built_for(CUDAPlatform(torch.device(DEVICE), torch.float32, True, SINGLE)):
        on_triton = get_model_class(config)(config, SINGLE).to(DEVICE).eval()
    on_triton.load_state_dict(native.state_dict())
    ops = [m for m in on_triton.modules() if isinstance(m, CustomOp)]
    assert ops and all(op.forward_name == "forward_cuda" for op in ops)
    input_ids, positions, layout = warmup_batch(20, 64, 4, 16, torch.device(DEVICE))
    input_ids = torch.randint(0, config.vocab_size, input_ids.shape, device=DEVICE)

    def logits(model):
        layer = next(m for m in model.modules() if hasattr(m, "k_cache"))
        backend = TorchNativeBackend(layer.num_heads, layer.num_kv_heads, layer.head_dim, 16)
        cache_shape = backend.kv_cache_shape(4)
        for m in model.modules():
            if hasattr(m, "k_cache"):
                m.k_cache, m.v_cache = torch.zeros(cache_shape, device=DEVICE), torch.zeros(cache_shape, device=DEVICE)
        with torch.inference_mode(), forward_context(backend, backend.prepare(layout)):
            return model.compute_logits(model(input_ids, positions))

    torch.testing.assert_close(logits(on_triton), logits(native), atol=1e-4, rtol=1e-4)
