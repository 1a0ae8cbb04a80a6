"""What the endpoints share between API requests and the engine: `Serving` (the model card, the
server's own tokenizer, the tool-call format, prompts and chat templates turned into engine
requests, constraints compiled before submission, response chunks) and the helpers every
response uses: sampling values, failed steps as 500s, token usage, server-sent events, and a
whole response that a client's disconnect aborts."""

import asyncio
import copy
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import StreamingResponse
from transformers import PreTrainedTokenizerBase

from nanovllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from nanovllm.engine.structured_output import ConstraintError
from nanovllm.entrypoints.openai_server.tools import ToolCalling
from nanovllm.entrypoints.protocol import APIError, ChatCompletionRequest, SamplingRequest
from nanovllm.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser, parser_for_template
from nanovllm.llm import chat_prompt
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


_SAMPLING_FIELDS = {field.name for field in dataclasses.fields(SamplingParams)}
# JSON has no -inf: a logprob that low is reported as this, as vLLM does.
MIN_LOGPROB = -9999.0


class Serving:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_prompts: int, tool_call_parser: str | None = None):
        """Made before the engine thread starts: it reads the engine. `tool_call_parser` names
        the model's tool-call format (TOOL_PARSERS); None tells it from the chat template."""
        self.engine = engine
        self.model_name = model_name
        self.max_prompts = max_prompts
        # The server tokenizes with its own copy: the engine's tokenizer belongs to the engine thread.
        self.tokenizer: PreTrainedTokenizerBase = copy.deepcopy(engine.engine.tokenizer)
        self.tool_parser: ToolParser = (TOOL_PARSERS[tool_call_parser]() if tool_call_parser is not None
                                        else parser_for_template(self.tokenizer.chat_template))
        # Constraints are compiled on request threads, ahead of the engine thread that uses them.
        self.structured_outputs = engine.engine.structured_outputs
        self.structured_outputs.prepare()
        config = engine.engine.config
        self.vocab_size = engine.engine.vocab_size
        # A pooling model (--runner pooling) serves /v1/embeddings only; a generating one all but it.
        self.pooling = config.runner == "pooling"
        self.model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "nanovllm",
                           "root": model_name, "max_model_len": config.max_model_len}

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> dict:
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt,
                                                                               add_special_tokens=add_special_tokens)}
        return {"prompt_token_ids": prompt}

    def apply_chat_template(self, body: ChatCompletionRequest, tools: ToolCalling) -> dict:
        """The request's messages (and tools, and its chat-template options) as a prompt."""
        template = body.chat_template or self.tokenizer.chat_template
        if template is None:
            raise APIError(400, "This model has no chat template; use /v1/completions, or send chat_template.",
                           param="messages")
        messages, template_kwargs = tools.template_inputs(body.messages, template)
        # The template's own variables first: the named options below win over them.
        options = {**(body.chat_template_kwargs or {}), **template_kwargs,
                   "add_generation_prompt": body.add_generation_prompt,
                   "continue_final_message": body.continue_final_message}
        if body.chat_template is not None:
            options["chat_template"] = body.chat_template
        if body.documents is not None:
            options["documents"] = body.documents
        try:
            return chat_prompt(self.tokenizer, messages, add_special_tokens=body.add_special_tokens, **options)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise APIError(400, f"The model's chat template rejected the messages: {e}", param="messages") from None

    async def submit(self, response_id: str, prompts: list[dict], params: SamplingParams,
                     constraint_field: str = "structured_outputs") -> RequestStream:
        """Queue the prompts; a constraint is compiled first, off the engine thread, and one the
        grammar library rejects is a 400 naming `constraint_field`."""
        if self.pooling:
            raise APIError(400, f"The model `{self.model_name}` serves embeddings (it was started with --runner "
                                "pooling), so it cannot generate; use /v1/embeddings.", param="model")
        if params.structured_outputs is not None:
            try:
                await asyncio.to_thread(self.structured_outputs.compile, params.structured_outputs)
            except ConstraintError as e:
                field = f"structured_outputs.{e.kind}" if constraint_field == "structured_outputs" else constraint_field
                raise APIError(400, f"{field} is not valid: {e.reason}", param=field) from None
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        try:
            return await self.engine.add_requests(request_ids, prompts, params)
        except (ValueError, TypeError) as e:  # a prompt, or a value for this model, the engine will not take
            # Messages about a sampling value start with its name ("stop_token_ids must be ...").
            raise APIError(400, str(e), param=_field_named_by(e) or "prompt") from None

    def chunk(self, response_id: str, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": response_id, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": choices, **extra}


def sampling_params(body: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except ValueError as e:  # SamplingParams names the field first: "temperature must be ..."
        raise APIError(400, str(e), param=_field_named_by(e)) from None


def _field_named_by(error: ValueError) -> str | None:
    """SamplingParams' messages start with the field's name ("stop[0] must be ...",
    "structured_outputs.regex must be ...")."""
    name = str(error).split(" ", 1)[0]
    return name if re.split(r"[\[.]", name, maxsplit=1)[0] in _SAMPLING_FIELDS else None


def finite_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def raise_if_failed(output: RequestOutput) -> None:
    """A request whose step failed (the engine logged why and went on) is answered as a 500."""
    if any(completion.finish_reason == "error" for completion in output.outputs):
        raise APIError(500, "The engine failed while running this request; the server log says why.",
                       type="server_error")


def token_usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse_response(stream: RequestStream, chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events as OpenAI sends them: `data: {json}` per chunk, then `data: [DONE]`."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except EngineDeadError as e:  # the status line is long gone: the error travels as an event
            yield f"data: {json.dumps(APIError(503, str(e), type='server_error').body())}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            # Runs also when the client disconnects (Starlette cancels this generator).
            stream.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def collect_unless_disconnected(stream: RequestStream, request: Request) -> dict[str, RequestOutput] | None:
    """Each request's final output, or None if the client disconnected first (then all are aborted)."""

    async def collect() -> dict[str, RequestOutput]:
        return {output.request_id: output async for output in stream}

    async def disconnected():
        # The body has been read: the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting, watching = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            stream.abort()
    return collecting.result() if collecting in done else None
