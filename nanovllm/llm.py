"""`LLM`: the offline entry point, as in vLLM (`LLM(model).generate(prompts, params)`)."""

import time

import jinja2
from tqdm.auto import tqdm

from nanovllm.startup import log_breakdown
from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams, check_text


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        start = time.perf_counter()
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        log_breakdown(time.perf_counter() - start)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts; outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        engine = self.llm_engine
        # Validate every prompt before queueing any, so a bad one leaves nothing half-done.
        requests = [engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        for request in requests:
            engine.enqueue(request)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        prefill_start, decode_start = engine.prefill_tokens_computed, engine.decode_tokens_computed
        with bar:
            while engine.has_unfinished():
                for output in engine.step():
                    if output.finished:
                        final[output.request_id] = output
                        bar.update(1)
                if use_tqdm:
                    elapsed = max(bar.format_dict["elapsed"], 1e-9)
                    bar.set_postfix(prefill=f"{(engine.prefill_tokens_computed - prefill_start) / elapsed:.0f}tok/s",
                                    decode=f"{(engine.decode_tokens_computed - decode_start) / elapsed:.0f}tok/s",
                                    refresh=False)
        return [final[request.request_id] for request in requests]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        prompts = [chat_prompt(tokenizer, c, **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict:
        return self.llm_engine.get_metrics()


def chat_prompt(tokenizer, conversation: list[dict], **template_kwargs) -> dict:
    """A conversation through the model's chat template, as a prompt the engine takes.

    A template that rejects a system message (Gemma 2's has no system role) gets the
    conversation with the system text put before the first user message's, as the templates that
    take one fold it in (Gemma 3's); any other rejection is the caller's to report."""
    for i, message in enumerate(conversation):
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            check_text(f"messages[{i}].content", message["content"])
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)
    except jinja2.TemplateError:
        folded = _system_folded_into_first_user_message(conversation)
        if folded is None:
            raise
        text = tokenizer.apply_chat_template(folded, tokenize=False, add_generation_prompt=True, **template_kwargs)
    # The template already holds the special tokens the model wants.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _system_folded_into_first_user_message(conversation: list[dict]) -> list[dict] | None:
    """The conversation without its leading system message, whose text leads the first user
    message's instead; None where there is no leading system message and a user message after
    it, both of plain text."""
    if len(conversation) < 2 or not all(isinstance(m, dict) for m in conversation[:2]):
        return None
    system, user = conversation[0], conversation[1]
    if (system.get("role") != "system" or user.get("role") != "user"
            or not isinstance(system.get("content"), str) or not isinstance(user.get("content"), str)):
        return None
    return [{**user, "content": f"{system['content']}\n\n{user['content']}"}, *conversation[2:]]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
