"""POST /v1/completions: one engine request per prompt, their choices whole or streamed, with
echo and OpenAI's legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.engine.async_engine import RequestStream
from nanovllm.entrypoints.openai_server.serving import (Serving, collect_unless_disconnected, finite_logprob,
                                                        raise_if_failed, sampling_params, sse_response,
                                                        token_usage)
from nanovllm.entrypoints.openai_server.streaming import StreamedChoices, StreamedUsage
from nanovllm.entrypoints.protocol import APIError, CompletionRequest
from nanovllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


async def create_completion(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    serving.check_model(body.model)
    # With echo, the prompt's logprobs come back too (OpenAI's legacy scoring idiom).
    params = sampling_params(body, body.max_tokens, body.logprobs, body.logprobs if body.echo else None)
    if len(body.prompts()) > serving.max_prompts:
        raise APIError(400, f"A request may hold at most {serving.max_prompts} prompts, got {len(body.prompts())} "
                            "(the server's --max-prompts-per-request); send the rest in other requests.",
                       param="prompt")
    prompts = [serving.encode(p, body.add_special_tokens) for p in body.prompts()]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    stream = await serving.submit(response_id, prompts, params, body.constraint_field)
    echoes = [p.get("prompt") or serving.tokenizer.decode(p["prompt_token_ids"]) for p in prompts] \
        if body.echo else None
    builder = CompletionChoices(serving, body, echoes)
    if body.stream:
        return sse_response(stream, builder.stream_chunks(stream, response_id))
    finals = await collect_unless_disconnected(stream, request)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    outputs = [finals[f"{response_id}-{i}"] for i in range(len(prompts))]
    for output in outputs:
        raise_if_failed(output)
    choices = [builder.whole_choice(i, out, completion) for i, out in enumerate(outputs)
               for completion in out.outputs]
    return JSONResponse({"id": response_id, "object": "text_completion", "created": int(time.time()),
                         "model": serving.model_name, "choices": choices, "usage": token_usage(outputs)})


class CompletionChoices:
    """Choices of one /v1/completions response: index = prompt number * n + completion index."""

    def __init__(self, serving: Serving, body: CompletionRequest, echoes: list[str] | None):
        self.serving = serving
        self.body = body
        self.echoes = echoes

    def whole_choice(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> dict:
        text, logprobs = completion.text, None
        token_ids, positions = completion.token_ids, completion.logprobs
        if self.echoes is not None:
            text = self.echoes[prompt_index] + text
            if self.body.logprobs is not None:
                token_ids = output.prompt_token_ids + token_ids
                positions = output.prompt_logprobs + positions
        if self.body.logprobs is not None:
            logprobs = self._legacy_logprobs(token_ids, positions, 0)
        return {"index": prompt_index * self.body.n + completion.index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    async def stream_chunks(self, stream: RequestStream, response_id: str) -> AsyncIterator[dict]:
        body = self.body
        usage = StreamedUsage(body, 0)
        choices = StreamedChoices(with_logprobs=body.logprobs is not None)
        finals: list[RequestOutput] = []

        def chunk(choice: dict) -> dict:
            return self.serving.chunk(response_id, "text_completion", [choice], **usage.on_chunk())

        async for output in stream:
            raise_if_failed(output)
            usage.advance([output])
            p = _prompt_number(output.request_id)
            echo = self.echoes[p] if self.echoes is not None else ""
            for completion in output.outputs:
                index = p * body.n + completion.index
                step = choices.advance(index, completion)
                if step is None:
                    continue
                if step.opens and self.echoes is not None:  # the echoed prompt comes first, in its own chunk
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self._legacy_logprobs(output.prompt_token_ids, output.prompt_logprobs, 0)
                    yield chunk({"index": index, "text": echo, "logprobs": logprobs, "finish_reason": None})
                if step.sends_delta:
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = self._legacy_logprobs(step.token_ids, step.logprobs, len(echo) + step.text_offset)
                    yield chunk({"index": index, "text": step.text, "logprobs": logprobs, "finish_reason": None})
                if step.finishes:
                    yield chunk({"index": index, "text": "", "logprobs": None,
                                 "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
            if output.finished:
                finals.append(output)
        if body.include_usage:
            yield self.serving.chunk(response_id, "text_completion", [], usage=token_usage(finals))

    def _legacy_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                         text_offset: int) -> dict:
        """OpenAI's legacy completions logprobs; text_offset indexes the choice's whole text."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, position in zip(token_ids, positions):
            if position is None:  # a prompt's first token has no logprob
                token, logprob, top = self.serving.tokenizer.decode([token_id]), None, None
            else:
                token, logprob = position[token_id].decoded_token, finite_logprob(position[token_id].logprob)
                top = {entry.decoded_token: finite_logprob(entry.logprob) for entry in position.values()}
            tokens.append(token)
            token_logprobs.append(logprob)
            top_logprobs.append(top)
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def _prompt_number(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])  # request ids are f"{response_id}-{prompt number}"
