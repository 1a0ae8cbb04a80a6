"""Constrained decoding on llguidance: what each constraint compiles to, the per-sequence matcher
that follows its generated tokens, and the batch's bitmask of allowed tokens for the sampler.

llguidance was chosen over xgrammar by measurement on the default model's 49k vocabulary (see
benchmarks/RESULTS.md): both fill a mask in microseconds, far below a step, and llguidance
compiles a schema several times faster, ships as one wheel, and takes JSON schemas, regexes and
Lark grammars (with JSON schemas inside them, which tool calls need) alike.

A compiled constraint is a matcher at its start state, kept in a small LRU cache by constraint
and copied for each sequence, so the n streams of a request and later requests under the same
schema share one compilation. A sequence's matcher consumes every token the sequence generates
(the engine feeds it after each draw); preemption by recompute keeps it as it is, since the
tokens it has consumed stay in the sequence. The matcher allows EOS exactly where the grammar
accepts, and once it has stopped (nothing may follow) the sequence ends.

A JSON schema's objects that declare properties but say nothing of others get
`additionalProperties: false` (unless the engine's structured_outputs_config turns
disable_additional_properties off): llguidance, like the JSON Schema standard, lets undeclared
keys through, where vLLM's default backend forbids them, and a small model fills that room with
junk keys that break the client's parsing.

llguidance is imported on first use: an engine without it runs every unconstrained request.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    import llguidance

from nanovllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHED_GRAMMARS = 256
# Compact JSON: a small model given free whitespace between tokens may fill max_tokens with it.
JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance() -> ModuleType:
    """llguidance, with its transformers and torch helpers loaded."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise ValueError("structured outputs need the llguidance package, which is not installed here: "
                         "pip install llguidance") from None
    return llguidance


class ConstraintError(ValueError):
    """llguidance rejected a constraint: `kind` is the StructuredOutputsParams field, `reason` its words."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"structured_outputs.{kind} is not valid: {reason}")
        self.kind, self.reason = kind, reason


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token: int) -> None:
        """Consume the token just generated. The mask let only allowed tokens through; should one
        not be (a caller's stop token the grammar forbids), the matcher stops in its error state."""
        if not self.matcher.consume_token(token):
            logger.warning("a constrained sequence generated a token its grammar rejects: %s",
                           self.matcher.get_error())

    @property
    def finished(self) -> bool:
        """Nothing may follow: the grammar is complete (or the matcher failed)."""
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, one after another from here, the grammar accepts (speculative
        decoding cuts a draft there); nothing is consumed."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def after(self, tokens: list[int]) -> "GrammarState":
        """A copy of this state that has consumed `tokens` (valid ones): where a draft's later row
        is masked from."""
        if not tokens:
            return self
        matcher = self.matcher.deep_copy()
        matcher.consume_tokens(tokens)
        return GrammarState(matcher)


class StructuredOutputs:
    """Compiles constraints for one tokenizer into matchers, one per sequence."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: set[int],
                 forbid_undeclared_properties: bool = True):
        self.hf_tokenizer = tokenizer
        self.forbid_undeclared_properties = forbid_undeclared_properties
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()  # the server compiles on its own threads, the engine thread steps
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use: it walks the vocabulary
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now rather than at the first constraint
        (without llguidance, nothing: constraints are refused when they come)."""
        with self._lock:
            try:
                self._llg_tokenizer()
            except ValueError as e:
                logger.warning("%s", e)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = _llguidance().hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's matcher at its start state, from the cache when compiled before.
        Raises ConstraintError when llguidance rejects the schema, regex or grammar."""
        key = params.key
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
            tokenizer = self._llg_tokenizer()
        llg = _llguidance()
        grammar = _grammar(llg, params, self.forbid_undeclared_properties)
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(params.kind, _summary(matcher.get_error()))
        # The first mask builds the lexer's start state, which every copy then shares.
        bitmask = llg.torch.allocate_token_bitmask(1, self.vocab_size)
        llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def new_state(self, compiled: llguidance.LLMatcher) -> GrammarState:
        """A sequence's own state, at the start of a constraint `compile` returned."""
        with self._lock:
            return GrammarState(compiled.deep_copy())


_executor: llguidance.LLExecutor | None = None  # llguidance's thread pool, made on first use


def grammar_bitmask(states: list[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """[rows, ceil(vocab_size / 32)] int32, bit j of word w allowing token 32 * w + j, for the
    rows of `states`; unconstrained rows (None) allow everything. None if no row is constrained.
    llguidance fills the rows in parallel, outside the GIL."""
    global _executor
    rows = [(state.matcher, row) for row, state in enumerate(states) if state is not None]
    if not rows:
        return None
    llg = _llguidance()
    if _executor is None:
        _executor = llg.LLExecutor()
    bitmask = torch.full(llg.torch.get_bitmask_shape(len(states), vocab_size), -1, dtype=torch.int32)
    llg.torch.fill_next_token_bitmask_par(_executor, rows, bitmask)
    return bitmask


def _grammar(llg: ModuleType, params: StructuredOutputsParams, forbid_undeclared_properties: bool) -> str:
    """llguidance's grammar text for one constraint."""
    kind = params.kind
    try:
        if kind == "json":
            schema = without_undeclared_properties(params.json) if forbid_undeclared_properties else params.json
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llg.grammar_from("choice", params.choice)
        return llg.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ConstraintError(kind, _summary(str(e))) from None


# The keywords whose values are schemas, lists of schemas, or maps of names to schemas: the
# walk below goes through these only, so that a property named "properties" is not taken for one.
_SCHEMA_KEYWORDS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                    "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def without_undeclared_properties(schema):
    """A copy of a JSON schema in which every object schema that declares properties and does
    not say whether others may follow (additionalProperties / unevaluatedProperties) forbids them."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SCHEMA_KEYWORDS:
        if key in result:
            result[key] = without_undeclared_properties(result[key])
    for key in _SCHEMA_LIST_KEYWORDS:
        if isinstance(result.get(key), list):
            result[key] = [without_undeclared_properties(s) for s in result[key]]
    for key in _SCHEMA_MAP_KEYWORDS:
        if isinstance(result.get(key), dict):
            result[key] = {name: without_undeclared_properties(s) for name, s in result[key].items()}
    declares = "properties" in result or "patternProperties" in result
    if declares and "additionalProperties" not in result and "unevaluatedProperties" not in result:
        result["additionalProperties"] = False
    return result


def _summary(message: str) -> str:
    """llguidance's messages span lines (the grammar quoted, a caret under the fault): the first
    says what is wrong, and an `error:` line, if any, why."""
    lines = [line.strip() for line in message.strip().split("\n")]
    return " ".join([lines[0]] + [line for line in lines[1:] if line.startswith("error:")])
