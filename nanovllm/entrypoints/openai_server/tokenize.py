"""POST /tokenize and /detokenize, in vLLM's shapes: a text prompt (or chat messages through the
chat template, as a chat request would see them) to token ids, and token ids back to text."""

from nanovllm.entrypoints.openai_server.serving import Serving
from nanovllm.entrypoints.openai_server.tools import ToolCalling
from nanovllm.entrypoints.protocol import (APIError, DetokenizeRequest, TokenizeChatRequest,
                                           TokenizeCompletionRequest, parse_request)


def tokenize(serving: Serving, data: dict) -> dict:
    """`data`: the decoded body; with `messages` it is a chat request's, else a prompt's."""
    if isinstance(data, dict) and "messages" in data:
        body = parse_request(TokenizeChatRequest, data, "/tokenize")
        serving.check_model(body.model)
        token_ids = serving.apply_chat_template(body, ToolCalling(body, serving.tool_parser))["prompt_token_ids"]
    else:
        body = parse_request(TokenizeCompletionRequest, data, "/tokenize")
        serving.check_model(body.model)
        token_ids = serving.encode(body.prompt, body.add_special_tokens)["prompt_token_ids"]
    strings = serving.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return {"count": len(token_ids), "max_model_len": serving.model_card["max_model_len"], "tokens": token_ids,
            "token_strs": strings}


def detokenize(serving: Serving, data: dict) -> dict:
    body = parse_request(DetokenizeRequest, data, "/detokenize")
    serving.check_model(body.model)
    vocab_size = serving.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"tokens must be token ids in [0, {vocab_size}); got {bad[:5]}", param="tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens)}
