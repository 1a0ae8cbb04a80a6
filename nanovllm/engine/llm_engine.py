"""The offline engine: validates and tokenizes requests, then steps scheduler and model
runner until every sequence finishes."""

import json
import os
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


@dataclass
class StepResult:
    finished: list[Sequence]
    num_prefill_tokens: int  # tokens of prompt chunks computed this step
    num_decode_tokens: int  # sequences that advanced by one generated token


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = collect_eos_token_ids(config, self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, self.eos_token_ids)
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def make_sequence(self, prompt, sampling_params: SamplingParams) -> Sequence:
        """Validate and tokenize one prompt; raises ValueError before anything is queued."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key, "
                                 f"got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); "
                                 f"got {bad[:5]}")
        else:
            raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        max_len = self.config.max_model_len
        if len(token_ids) + sampling_params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling_params.max_tokens}) "
                             f"= {len(token_ids) + sampling_params.max_tokens} exceeds max_model_len={max_len}")
        return Sequence(token_ids, sampling_params)

    def add_sequence(self, seq: Sequence):
        self.prompt_tokens += seq.num_prompt_tokens
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        batch = self.scheduler.schedule()
        sampled = self.model_runner.execute(batch)
        num_decode = sum(1 for seq, n in zip(batch.seqs, batch.num_new_tokens)
                         if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens)
        finished = self.scheduler.postprocess(batch, sampled)
        self.generation_tokens += len(sampled)
        return StepResult(finished, batch.num_tokens - num_decode, num_decode)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def get_metrics(self) -> dict:
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "num_kvcache_blocks": self.block_manager.num_blocks,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


def load_tokenizer(config: EngineConfig) -> PreTrainedTokenizerBase:
    if config.is_gguf:
        from nanovllm.loader.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(config.model_path)
    return AutoTokenizer.from_pretrained(config.model_path)


def collect_eos_token_ids(config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every EOS id the model declares: config, generation_config.json and tokenizer."""
    if config.is_gguf:
        from nanovllm.loader.gguf import gguf_eos_token_ids
        return set(gguf_eos_token_ids(config.model_path, tokenizer))
    ids = set(_as_list(getattr(config.hf_config, "eos_token_id", None)))
    gen_file = os.path.join(config.model_path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            ids.update(_as_list(json.load(f).get("eos_token_id")))
    ids.update(_as_list(tokenizer.eos_token_id))
    return ids


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
