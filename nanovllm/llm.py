"""`LLM`: the offline entry point, as in vLLM (`LLM(model).generate(prompts, params)`)."""

import time

import jinja2
from tqdm.auto import tqdm

from nanovllm.startup import log_breakdown
from nanovllm.config import EngineConfig
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import EmbeddingRequestOutput, RequestOutput
from nanovllm.pooling_params import PoolingParams
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
        return self._run(prompts, _one_per_prompt(sampling_params, SamplingParams, len(prompts)), use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list of them (a model started with runner="pooling"); each output's
        `.outputs.embedding` is its vector, in input order."""
        prompts = _as_prompt_list(prompts)
        return self._run(prompts, _one_per_prompt(pooling_params, PoolingParams, len(prompts)), use_tqdm)

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list:
        """Queue one request per prompt with its params, step until all are done, and return their
        final outputs in input order."""
        engine = self.llm_engine
        # Validate every prompt before queueing any, so a bad one leaves nothing half-done.
        requests = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for request in requests:
            engine.enqueue(request)
        final: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
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


def chat_prompt(tokenizer, conversation: list[dict], add_special_tokens: bool = False, **template_kwargs) -> dict:
    """A conversation through the model's chat template, as a prompt the engine takes;
    `template_kwargs` go to transformers' apply_chat_template (add_generation_prompt, True unless
    given; continue_final_message, chat_template, tools, documents, the template's own variables).

    A template that rejects a system message (Gemma 2's has no system role) gets the
    conversation with the system text put before the first user message's, as the templates that
    take one fold it in (Gemma 3's); any other rejection is the caller's to report."""
    for i, message in enumerate(conversation):
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            check_text(f"messages[{i}].content", message["content"])
    template_kwargs.setdefault("add_generation_prompt", True)
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **template_kwargs)
    except jinja2.TemplateError:
        folded = _system_folded_into_first_user_message(conversation)
        if folded is None:
            raise
        text = tokenizer.apply_chat_template(folded, tokenize=False, **template_kwargs)
    # By default none are added: the template already holds the special tokens the model wants.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}


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


def _one_per_prompt(params, kind: type, num_prompts: int) -> list:
    """`params` (None: the defaults of `kind`; one for all; or one per prompt) as one per prompt."""
    if params is None:
        params = kind()
    if isinstance(params, kind):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} {kind.__name__} for {num_prompts} prompts; give one, or one per prompt")
    return params


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
