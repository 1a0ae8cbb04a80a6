"""The server's leniency, as vLLM's: every field of the installed `openai` package's chat and
completions request types, and of vLLM's extensions, is either honoured, ignored with a warning
naming it, or refused with a 400 that says why -- none a surprise. Also vLLM's continuous usage
stats, chat-template options, /tokenize and /detokenize, and the text-only refusal of media parts.
A real server on a tiny random checkpoint; greedy outputs compared with the offline engine."""

import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from conftest import make_tiny_checkpoint
from nanovllm import LLM
from nanovllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from nanovllm.llm import chat_prompt
from test_server import MODEL, Server, greedy, post, sse

API_KEY = "test-key"
USER = [{"role": "user", "content": "Hello there"}]
TOOL = {"type": "function", "function": {"name": "now", "parameters": {}}}

# A value for each field, as a client would send it: harmless where the field has a harmless value.
SAMPLE_VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "best_of": 2, "echo": True, "frequency_penalty": 0.1,
    "function_call": "auto", "functions": [{"name": "f", "parameters": {}}], "logit_bias": {"5": 0.5},
    "logprobs": True, "max_completion_tokens": 2, "max_tokens": 2, "metadata": {"k": "v"}, "modalities": ["text"],
    "moderation": {"enabled": False}, "n": 2, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.1, "prompt_cache_key": "k",
    "prompt_cache_options": {}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "text"}, "safety_identifier": "user-1", "seed": 1, "service_tier": "auto",
    "stop": ["\n\n"], "store": False, "stream_options": {"include_usage": True}, "suffix": "!", "temperature": 0.5,
    "tool_choice": "none", "tools": [TOOL], "top_logprobs": 2, "top_p": 0.9, "user": "u", "verbosity": "low",
    "web_search_options": {},
    # vLLM's extensions
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "length_penalty": 1.0, "stop_token_ids": [3],
    "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4, "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "use_beam_search": True, "add_generation_prompt": False,
    "continue_final_message": False, "add_special_tokens": True, "documents": [{"title": "t", "text": "d"}],
    "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "chat_template_kwargs": {"enable_thinking": False}, "mm_processor_kwargs": {},
    "structured_outputs": {"choice": ["a", "b"]}, "priority": 1, "request_id": "r-1", "cache_salt": "s",
    "kv_transfer_params": {}, "vllm_xargs": {}, "return_tokens_as_token_ids": True,
    "guided_json": {"type": "object"}, "guided_choice": ["a"],
}
VLLM_EXTENSIONS = ["top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
                   "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                   "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
                   "bad_words", "use_beam_search", "best_of", "structured_outputs", "priority", "request_id",
                   "cache_salt", "kv_transfer_params", "vllm_xargs", "return_tokens_as_token_ids", "guided_json",
                   "guided_choice"]
CHAT_EXTENSIONS = ["echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
                   "chat_template", "chat_template_kwargs", "mm_processor_kwargs"]
COMPLETION_EXTENSIONS = ["echo", "add_special_tokens"]


def _openai_fields(params_module) -> set[str]:
    fields = set(typing.get_type_hints(params_module.CompletionCreateParamsBase))
    return fields | {"stream"}


CHAT_FIELDS = sorted(_openai_fields(chat_create_params) - {"messages", "model"} | set(VLLM_EXTENSIONS)
                     | set(CHAT_EXTENSIONS))
COMPLETION_FIELDS = sorted(_openai_fields(completion_create_params) - {"prompt", "model"} | set(VLLM_EXTENSIONS)
                           | set(COMPLETION_EXTENSIONS))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fields-ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = Server(checkpoint, tmp_path_factory.mktemp("fields-server") / "server.log", "--api-key", API_KEY)
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(checkpoint) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kvcache_blocks=128)


def _expect(request_model, field: str, body: dict) -> str:
    """"refused" when the model turns the body's value of the field away, else "accepted"."""
    if field in request_model.refused:
        harmless, _ = request_model.refused[field]
        return "accepted" if harmless(body[field], body) else "refused"
    return "accepted"


@pytest.mark.parametrize("endpoint, request_model, fields", [
    ("/v1/chat/completions", ChatCompletionRequest, CHAT_FIELDS),
    ("/v1/completions", CompletionRequest, COMPLETION_FIELDS),
], ids=["chat", "completions"])
def test_every_field_is_honoured_ignored_or_refused_on_purpose(server, endpoint, request_model, fields):
    # On purpose: each field is declared (honoured), known to change nothing here, or refused.
    purposes = set(request_model.model_fields) | request_model.harmless | set(request_model.refused)
    assert not set(fields) - purposes, "fields the server has no purpose for"
    base = {"messages": USER} if endpoint == "/v1/chat/completions" else {"prompt": "Hello"}
    base |= {"model": MODEL, "max_tokens": 2}
    for field in fields:
        value = SAMPLE_VALUES.get(field, True)
        body = {**base, field: value}
        if field in ("stream", "stream_options"):
            body["stream"] = True
        if field in ("top_logprobs", "logprobs") and endpoint == "/v1/chat/completions":
            body["logprobs"] = True
        if field == "logprobs" and endpoint == "/v1/completions":
            body["logprobs"] = 2
        if field == "tools":  # not shown to the model: the tiny one's context has no room for them
            body["tool_choice"] = "none"
        if field == "continue_final_message":
            body |= {"continue_final_message": True, "add_generation_prompt": False,
                     "messages": [*USER, {"role": "assistant", "content": "Hi"}]}
        response = post(server, endpoint, body, key=API_KEY)
        expected = _expect(request_model, field, body)
        if expected == "refused":
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["param"] == field and f"{field} is not supported" in error["message"], error
        else:
            assert response.status_code == 200, (field, response.text)
    # The fields it ignored are named in the log.
    log = server.log.read_text()
    assert "fields ignored" in log and "metadata" in log and "prompt_cache_key" in log


def test_unknown_fields_are_ignored_and_bad_values_of_known_ones_are_not(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "a_field_of_tomorrow": {"x": 1}}
    assert post(server, "/v1/completions", body).status_code == 200
    response = post(server, "/v1/completions", {**body, "temperature": "hot"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    # top_logprobs 0 without logprobs asks for nothing (vLLM lets it through); 2 is refused.
    chat = {"model": MODEL, "messages": USER, "max_tokens": 2}
    assert post(server, "/v1/chat/completions", {**chat, "top_logprobs": 0}).status_code == 200
    assert post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}).status_code == 400
    assert post(server, "/v1/completions", {**body, "best_of": 1}).status_code == 200  # = n: nothing changes


def test_continuous_usage_stats(server, offline):
    body = {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [e for e in sse(post(server, "/v1/chat/completions", body)) if e != "[DONE]"]
    prompt_tokens = len(chat_prompt(offline.get_tokenizer(), USER)["prompt_token_ids"])
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"]["prompt_tokens"] == prompt_tokens for e in events)
    assert all(e["usage"]["total_tokens"] == prompt_tokens + e["usage"]["completion_tokens"] for e in events)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    assert events[-1]["choices"] == []  # include_usage's own last chunk still comes
    # guidellm's request: continuous usage on completions.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [e for e in sse(post(server, "/v1/completions", body)) if e != "[DONE]"]
    assert all(e["usage"] is not None for e in events) and events[-1]["usage"]["completion_tokens"] == 4


def test_media_parts_are_refused_as_text_only(server):
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    response = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "takes text only" in error["message"] and "image_url" in error["message"]
    assert error["param"] == "messages[0].content"


def test_tokenize_and_detokenize(server, offline):
    tokenizer = offline.get_tokenizer()
    response = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True})
    assert response.status_code == 200
    out = response.json()
    assert out["tokens"] == tokenizer.encode("Hello there") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256 and out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    # Chat messages: the prompt a chat request runs, and vLLM's template options.
    chat = post(server, "/tokenize", {"messages": USER}).json()
    assert chat["tokens"] == chat_prompt(tokenizer, USER)["prompt_token_ids"] and chat["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": USER, "add_generation_prompt": False}).json()
    assert chat["tokens"][:len(bare["tokens"])] == bare["tokens"] and len(bare["tokens"]) < len(chat["tokens"])
    reply = [*USER, {"role": "assistant", "content": "General Kenobi"}]
    continued = post(server, "/tokenize", {"messages": reply, "add_generation_prompt": False,
                                           "continue_final_message": True}).json()
    assert tokenizer.decode(continued["tokens"]).endswith("General Kenobi")
    back = post(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(out["tokens"])}
    # Bad input: clear errors, and the server goes on.
    bad = post(server, "/detokenize", {"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                      "continue_final_message": True}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x"}).status_code == 200


def test_chat_template_options_reach_the_template(server, offline):
    """chat_template_kwargs are the template's variables; chat_template replaces the model's."""
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    body = {"messages": USER, "chat_template": template, "chat_template_kwargs": {"greeting": "Hi"}}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert offline.get_tokenizer().decode(tokens) == "Hi|Hello there"
    response = post(server, "/v1/chat/completions", {**body, "model": MODEL, "max_tokens": 3, "temperature": 0})
    [expected] = greedy(offline, [{"prompt_token_ids": tokens}], max_tokens=3)
    assert response.json()["choices"][0]["message"]["content"] == expected.text
