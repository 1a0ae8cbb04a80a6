"""Chat templates without a system role (Gemma 2's raises on one): the chat path puts a leading
system message's text before the first user message's, as templates that take one do; any other
rejection still reaches the caller."""

import jinja2
import pytest

from conftest import make_tiny_tokenizer
from nanovllm.llm import chat_prompt

NO_SYSTEM_ROLE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ raise_exception('no system role in this template') }}{%- endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


@pytest.fixture
def tokenizer():
    tokenizer = make_tiny_tokenizer(320)
    tokenizer.chat_template = NO_SYSTEM_ROLE
    return tokenizer


def test_a_leading_system_message_is_folded_into_the_first_user_message(tokenizer):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    folded = [{"role": "user", "content": "Be brief.\n\nHi"}, *conversation[2:]]
    assert chat_prompt(tokenizer, conversation) == chat_prompt(tokenizer, folded)
    assert "Be brief.\n\nHi" in chat_prompt(tokenizer, conversation)["prompt"]


def test_other_rejections_reach_the_caller(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}])
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        chat_prompt(tokenizer, [{"role": "system", "content": "Alone."}])
