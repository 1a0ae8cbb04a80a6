"""The Triton experts (kernels/triton_moe.py) against the dense per-expert loop: the alignment of the
step's pairs by expert, and the grouped kernels on tiny shapes with edges (an intermediate size and a
hidden size that are not multiples of the tiles, experts no token chose, every token on one expert).

Without CUDA the kernels run on CPU tensors under Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1); skipped when triton is not installed."""

import pytest
import torch

from conftest import triton_skip_reason

if triton_skip_reason():
    pytest.skip(triton_skip_reason(), allow_module_level=True)

from nanovllm.kernels.triton_moe import align_by_expert, fused_moe  # noqa: E402
from nanovllm.layers.quantization.moe_methods import dense_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pairs_are_grouped_by_expert_and_padded_to_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])
    sorted_pairs, block_experts = align_by_expert(ids, num_experts=5, block_m=4)
    pairs = ids.numel()
    assert sorted_pairs.numel() == 4 * -(-(pairs + 5 * 3) // 4)  # room for any routing
    blocks = sorted_pairs.view(-1, 4).tolist()
    # Expert 0: pairs 1 and 4; expert 1: none; expert 2: pairs 0, 2 and 5; expert 3: pair 3.
    assert blocks[:3] == [[1, 4, pairs, pairs], [0, 2, 5, pairs], [3, pairs, pairs, pairs]]
    assert all(b == [pairs] * 4 for b in blocks[3:])
    assert block_experts.tolist() == [0, 2, 3] + [5] * (len(blocks) - 3)


@pytest.mark.parametrize("tokens,k,experts,hidden,intermediate,one_expert", [
    (5, 2, 4, 64, 48, False), (1, 4, 6, 40, 32, False), (20, 2, 4, 32, 16, True)])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_the_grouped_kernels_are_the_per_expert_loop(tokens, k, experts, hidden, intermediate, one_expert, activation):
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate ** 0.5
    ids = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    if one_expert:
        ids[:, 0] = 1
        ids[:, 1] = torch.where(ids[:, 1] == 1, 0, ids[:, 1])
    weights = torch.softmax(torch.randn(tokens, k, generator=generator), -1)
    expected = dense_moe(x, w13, w2, weights, ids, activation)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    got = fused_moe(*args, 0 if activation == "silu" else 1)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_the_cuda_platform_runs_experts_on_the_grouped_kernels():
    """Its dense experts' method is the Triton one, whose launches CUDA graphs capture; the plain
    per-expert loop (what a GPU without Triton gets) is not capturable, and decode steps then run eager."""
    from types import SimpleNamespace

    from conftest import family_config, make_tiny_config
    from nanovllm.distributed.parallel_state import SINGLE
    from nanovllm.layers.quantization.triton_moe import TritonMoEMethod
    from nanovllm.models.registry import get_model_class
    from nanovllm.platforms.cuda import CUDAPlatform

    platform = CUDAPlatform(torch.device(DEVICE), torch.float32, False, SINGLE)
    method = platform.dense_moe_method()
    assert type(method) is TritonMoEMethod and method.graph_capturable
    # Built without a chooser, the experts take the plain loop: the platform captures no graphs.
    config = make_tiny_config("Qwen3MoeForCausalLM", **family_config("qwen3-moe", None)[1])
    plain = get_model_class(config)(config, SINGLE)
    assert platform.graph_runner(plain, SimpleNamespace(supports_cuda_graphs=True), None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_moe_decode_graphs_give_the_eager_tokens(tmp_path):
    from conftest import family_config, make_tiny_checkpoint
    from nanovllm import LLM, SamplingParams

    arch, overrides = family_config("qwen3-moe", None)
    path = str(make_tiny_checkpoint(tmp_path, arch, **overrides))
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    for enforce_eager in (True, False):
        llm = LLM(path, dtype="float32", device="cuda", num_kvcache_blocks=64, max_model_len=128, max_num_seqs=4,
                  enforce_eager=enforce_eager)
        assert (llm.llm_engine.executor.cuda_graphs is None) == enforce_eager
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]
