"""Tool calls without a model: each format's parser (whole texts, and how much of a growing one is
surely content), the parser told from chat templates, what tool_choice constrains the output to,
how tools and past calls reach a template, and the stream of tool-call deltas."""

import json

import jsonschema
import pytest

from nanovllm.entrypoints.openai_server.tools import ToolCalling
from nanovllm.entrypoints.protocol import ChatCompletionRequest, parse_request
from nanovllm.entrypoints.tool_parsers import (HermesParser, Llama3JsonParser, MistralParser, ToolCall,
                                               parser_for_template)

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]


def _request(**fields) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


# ----- parsers -----

@pytest.mark.parametrize("parser, text, content, calls", [
    (HermesParser(), 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                     '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
     "Let me add.", [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}")]),
    (HermesParser(), '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n',  # EOS before the closing tag
     None, [ToolCall("add", '{"a": 1, "b": 2}')]),
    (HermesParser(), "No tools needed.", "No tools needed.", []),
    (HermesParser(), "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (Llama3JsonParser(), '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "now", '
                         '"parameters": {}}', None, [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}")]),
    (Llama3JsonParser(), '{"name": "add", "parameters": "{\\"a\\": 3, \\"b\\": 4}"}', None,
     [ToolCall("add", '{"a": 3, "b": 4}')]),
    (Llama3JsonParser(), 'The answer is {"x": 1}', 'The answer is {"x": 1}', []),
    (MistralParser(), 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 5, "b": 6}}]', "Sure.",
     [ToolCall("add", '{"a": 5, "b": 6}')]),
    (MistralParser(), "[TOOL_CALLS] [{\"name\": 3}]", "[TOOL_CALLS] [{\"name\": 3}]", []),
])
def test_parsers(parser, text, content, calls):
    assert parser.parse(text) == (content, calls)


def test_content_end_holds_back_what_may_start_a_call():
    hermes = HermesParser()
    assert hermes.content_end("Hello <tool") == len("Hello ")
    assert hermes.content_end("Hello <tool_call>{") == len("Hello ")
    assert hermes.content_end("a < b") == len("a < b")
    assert Llama3JsonParser().content_end('  {"name"') == 0
    assert Llama3JsonParser().content_end("<|python") == 0
    assert Llama3JsonParser().content_end("Paris is") == len("Paris is")
    assert MistralParser().content_end("ok [TOOL") == len("ok ")


def test_hermes_complete_calls_while_streaming():
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "add", "argu'
    assert HermesParser().complete_calls(text) == [ToolCall("now", "{}")]
    assert Llama3JsonParser().complete_calls('{"name": "now", "parameters": {}}') == []


@pytest.mark.parametrize("template, parser", [
    ("{{ '<tool_call>' }}{% for tool in tools %}", HermesParser),
    ("{{ '[TOOL_CALLS]' }}", MistralParser),
    ("{{ '<|python_tag|>' }}{{ 'ipython' }}", Llama3JsonParser),
    ("{% for message in messages %}{{ message['content'] }}{% endfor %}", HermesParser),
    (None, HermesParser),
])
def test_parser_for_template(template, parser):
    assert isinstance(parser_for_template(template), parser)


# ----- tool_choice -----

def test_required_constraint_accepts_exactly_calls_of_the_tools():
    constraint = ToolCalling(_request(tools=TOOLS, tool_choice="required"), HermesParser()).constraint()
    schema = constraint.json
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}], schema)
    for bad in ([], [{"name": "add", "parameters": {"a": "x", "b": 2}}], [{"name": "mul", "parameters": {}}],
                [{"name": "now", "parameters": {"extra": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = ToolCalling(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                         HermesParser()).constraint().json
    assert single["maxItems"] == 1


def test_named_function_constraint_is_its_parameters():
    tools = ToolCalling(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
                        HermesParser())
    assert tools.constraint().json == ADD
    message = tools.message('{"a": 1, "b": 2}')
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and call["id"].startswith("call_")


def test_auto_and_none_do_not_constrain():
    assert ToolCalling(_request(tools=TOOLS), HermesParser()).constraint() is None
    none = ToolCalling(_request(tools=TOOLS, tool_choice="none"), HermesParser())
    assert not none.active and none.message("<tool_call>{}</tool_call>")["content"] == "<tool_call>{}</tool_call>"


# ----- the template's inputs -----

HISTORY = [
    {"role": "user", "content": "1 + 2?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]


def test_template_that_renders_tools_gets_them():
    tools = ToolCalling(_request(messages=HISTORY, tools=TOOLS), HermesParser())
    messages, kwargs = tools.template_inputs(_request(messages=HISTORY).messages, "{% for tool in tools %}")
    assert kwargs["tools"][0]["function"]["name"] == "add"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call_1"


def test_template_without_tools_gets_them_in_the_parsers_format():
    tools = ToolCalling(_request(messages=HISTORY, tools=TOOLS), HermesParser())
    messages, kwargs = tools.template_inputs(_request(messages=HISTORY).messages, "{{ message['content'] }}")
    assert kwargs == {} and messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert HermesParser().parse(messages[2]["content"])[1] == [ToolCall("add", '{"a": 1, "b": 2}')]


# ----- streaming -----

def _replay(tools: ToolCalling, text: str, pieces: int = 7) -> tuple[str, list[dict]]:
    """Feed `text` to a stream in growing prefixes; returns the content sent and the calls
    assembled from the deltas as a client does."""
    stream = tools.stream()
    content, calls = "", {}
    cuts = sorted({len(text) * i // pieces for i in range(1, pieces)} | {len(text)})
    for cut in cuts:
        delta, deltas = stream.advance(text[:cut], cut == len(text))
        content += delta
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            assert ("id" in d) == (call["name"] == "")  # the first delta of a call carries its id and name
            call["name"] += d["function"].get("name", "")
            call["arguments"] += d["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def test_stream_auto_hermes():
    text = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = _replay(ToolCalling(_request(tools=TOOLS), HermesParser()), text)
    assert content.strip() == "Adding." and calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    content, calls = _replay(ToolCalling(_request(tools=TOOLS), HermesParser()), "Just text < here.")
    assert content == "Just text < here." and calls == []


def test_auto_without_parallel_calls_keeps_the_first():
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>'
    tools = ToolCalling(_request(tools=TOOLS, parallel_tool_calls=False), HermesParser())
    assert [c["function"]["name"] for c in tools.message(text)["tool_calls"]] == ["now"]
    assert [c["name"] for c in _replay(tools, text)[1]] == ["now"]


def test_stream_required_and_named():
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]'
    content, calls = _replay(ToolCalling(_request(tools=TOOLS, tool_choice="required"), HermesParser()), text)
    assert content == "" and [c["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["arguments"]) == {"a": 1, "b": 2}
    named = ToolCalling(_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}),
                        HermesParser())
    content, calls = _replay(named, '{"a": 10, "b": 20}')
    assert content == "" and calls == [{"name": "add", "arguments": '{"a": 10, "b": 20}'}]


# ----- a reply cut by max_tokens -----

CUT_CASES = [  # (tool_choice, the text at the cut, the calls completed before it)
    ("required", '[{"name": "now", "parameters": {}}, {"name": "add", "parameters": {"a": 1', ["now"]),
    ("required", '[{"name": "add", "parameters": {"a": 1', []),
    ({"type": "function", "function": {"name": "add"}}, '{"a": 1, "b"', []),
    ({"type": "function", "function": {"name": "add"}}, '{"a": 1, "b": 2}', ["add"]),  # complete as the budget ran out
    ("auto", 'Sure.<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "add", "argu', ["now"]),
    ("auto", 'Sure.<tool_call>{"name": "add", "argu', []),
]


@pytest.mark.parametrize("tool_choice, text, names", CUT_CASES)
def test_a_cut_call_is_dropped_and_nothing_of_it_is_content(tool_choice, text, names):
    tools = ToolCalling(_request(tools=TOOLS, tool_choice=tool_choice), HermesParser())
    message = tools.message(text, cut=True)
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == names
    assert message["content"] in (None, "Sure.")
    # Streamed: the same calls, and the same content, as the text grows and is cut.
    stream = tools.stream()
    content, calls = "", []
    for end in range(1, len(text) + 1):
        delta, deltas = stream.advance(text[:end], end == len(text), cut=end == len(text))
        content += delta
        calls += [d["function"]["name"] for d in deltas]
    assert calls == names and (content or None) == message["content"]


def test_empty_parameters_mean_no_arguments():
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    named = ToolCalling(_request(tools=tools, tool_choice={"type": "function", "function": {"name": "now"}}),
                        HermesParser())
    schema = named.constraint().json
    jsonschema.validate({}, schema)
    for not_an_object in ([], None, 12345678901234567890, {"x": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(not_an_object, schema)
