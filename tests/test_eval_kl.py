"""`nanovllm eval-kl`: the statistics on known distributions, the command on a tiny checkpoint
quantized at load against its dense self, and llama.cpp scored beside us on a tiny GGUF file
(where llama-cpp-python is installed)."""

import math

import pytest
import torch

from conftest import make_tiny_checkpoint, write_tiny_gguf
from nanovllm.entrypoints import cli
from nanovllm.entrypoints.bench_twins import TwinShape
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


def _blocks(out: str) -> dict[str, dict[str, str]]:
    """Each engine's lines (after its "name:" line) as {key: value}."""
    blocks, current = {}, None
    for line in out.splitlines()[1:]:
        key, _, value = line.partition(":")
        if not value.strip():
            current = blocks.setdefault(key, {})
        else:
            current[key] = value.strip()
    return blocks


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels could not be built here")
def test_llama_cpp_is_scored_beside_us_on_the_same_file(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    shape = TwinShape("llama", 256, 512, 2, 4, 2, 64, 320, 10000.0, 1e-5, 256, True)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", shape, lambda name: "Q4_0")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    assert cli.main(["eval-kl", "--model", path, "--text", str(text), "--window", "32", "--step-tokens", "4",
                     "--num-kvcache-blocks", "16", "--compare", "llama.cpp"]) == 0
    blocks = _blocks(capsys.readouterr().out)
    assert set(blocks) == {"nano-vllm", "llama.cpp"}
    ours, theirs = blocks["nano-vllm"], blocks["llama.cpp"]
    assert ours["perplexity (reference)"] == theirs["perplexity (reference)"]  # one reference for both
    for engine in (ours, theirs):  # Q4_0 against its dense self: a small divergence, not none
        assert 0 < float(engine["mean KL divergence"]) < 0.05
        assert float(engine["top-1 agreement"].rstrip("%")) >= 80


def test_compare_needs_a_gguf_file(tmp_path, capsys):
    path = str(make_tiny_checkpoint(tmp_path / "model", hidden_size=64, intermediate_size=128, head_dim=32))
    assert cli.main(["eval-kl", "--model", path, "--window", "32", "--compare", "llama.cpp",
                     "--num-kvcache-blocks", "16"]) != 0
    assert f"--compare llama.cpp runs a GGUF file; {path} is not one" in capsys.readouterr().err
