"""`nanovllm eval-kl`: the statistics on known distributions, and the command on a tiny checkpoint
quantized at load against its dense self."""

import math

import pytest
import torch

from conftest import make_tiny_checkpoint
from nanovllm.entrypoints import cli
from nanovllm.entrypoints.eval_kl import compare
from nanovllm.kernels import cpu as cpu_kernels


def test_compare_on_known_distributions():
    reference = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), -1)
    test = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), -1)
    stats = compare(reference, test, torch.tensor([0, 1]))
    p = reference.exp()
    assert stats["kl"][0].item() == pytest.approx(0, abs=1e-7)
    assert stats["kl"][1].item() == pytest.approx((p[1] * (reference[1] - test[1])).sum().item())
    assert stats["agree"].tolist() == [1.0, 0.0]
    assert stats["nll"][1].item() == pytest.approx(-test[1, 1].item())


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels could not be built here")
def test_the_command_against_the_dense_model(tmp_path, capsys):
    path = str(make_tiny_checkpoint(tmp_path / "model", hidden_size=64, intermediate_size=128, head_dim=32))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    argv = ["eval-kl", "--model", path, "--text", str(text), "--window", "32", "--step-tokens", "4",
            "--num-kvcache-blocks", "16"]
    assert cli.main([*argv, "--quantization", "q8_0"]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines()[1:])
    kl, agreement = float(lines["mean KL divergence"]), float(lines["top-1 agreement"].strip().rstrip("%"))
    assert 0 < kl < 0.05 and agreement >= 80
    assert math.isfinite(float(lines["perplexity (reference)"]))
    assert cli.main([*argv, "--quantization", "dense", "--dtype", "float32", "--enforce-eager"]) == 0
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines()[1:])
    assert float(lines["mean KL divergence"]) == 0 and lines["top-1 agreement"].strip() == "100.00%"
