"""POST /v1/embeddings: one engine request per input, on a model started with --runner pooling;
the vectors as floats or as base64 of their little-endian float32 bytes, in input order."""

import base64
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.entrypoints.openai_server.serving import Serving, collect_unless_disconnected
from nanovllm.entrypoints.pooling_protocol import EmbeddingRequest
from nanovllm.entrypoints.protocol import APIError
from nanovllm.outputs import EmbeddingRequestOutput


async def create_embedding(serving: Serving, body: EmbeddingRequest, request: Request) -> Response:
    serving.check_model(body.model)
    if not serving.pooling:
        raise APIError(400, f"The model `{serving.model_name}` was not started as a pooling model, so it serves no "
                            "embeddings; start the server with --runner pooling.", param="model")
    inputs = body.inputs()
    if len(inputs) > serving.max_prompts:
        raise APIError(400, f"A request may hold at most {serving.max_prompts} inputs, got {len(inputs)} "
                            "(the server's --max-prompts-per-request); send the rest in other requests.",
                       param="input")
    try:
        params = body.pooling_params()
    except ValueError as e:  # PoolingParams names the field first: "dimensions must be ..."
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    prompts = [serving.encode(item, body.add_special_tokens) for item in inputs]
    response_id = f"embd-{uuid.uuid4().hex}"
    try:
        stream = await serving.engine.add_requests([f"{response_id}-{i}" for i in range(len(prompts))], prompts,
                                                   params)
    except (ValueError, TypeError) as e:  # a prompt, or dimensions, the model will not take
        param = "dimensions" if str(e).startswith("dimensions") else "input"
        raise APIError(400, str(e), param=param) from None
    finals = await collect_unless_disconnected(stream, request)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    outputs: list[EmbeddingRequestOutput] = [finals[f"{response_id}-{i}"] for i in range(len(prompts))]
    reasons = {output.finish_reason for output in outputs}
    if "error" in reasons:
        raise APIError(500, "The engine failed while running this request; the server log says why.",
                       type="server_error")
    if "abort" in reasons:  # only the server's shutdown aborts a request whose client is still there
        raise APIError(503, "The request was aborted: the server is shutting down.", type="server_error")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(output.outputs.embedding, body.encoding_format)}
            for i, output in enumerate(outputs)]
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return JSONResponse({"id": response_id, "object": "list", "created": int(time.time()),
                         "model": serving.model_name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
