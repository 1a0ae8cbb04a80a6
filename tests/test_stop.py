"""Stop checker: min_tokens holds back stop ids and EOS (banned for the sampler, ignored if
drawn), EOS unless ignored, stop token ids, length limits, and stop strings through the
detokenizer (a stop token's text left out unless asked for)."""

from conftest import make_tiny_tokenizer
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.stop import StopChecker
from nanovllm.sampling_params import SamplingParams

EOS = 2


def test_min_tokens_bans_and_ignores_stop_ids_and_eos_until_reached():
    checker = StopChecker(SamplingParams(min_tokens=2, stop_token_ids=[7, 5], max_tokens=10), eos_token_ids={EOS})
    assert checker.banned_token_ids(0) == checker.banned_token_ids(1) == [EOS, 5, 7]
    assert checker.banned_token_ids(2) == []
    assert checker.check(7, num_output_tokens=1, num_tokens=4) is None
    assert checker.check(7, num_output_tokens=2, num_tokens=5) == ("stop", 7)
    assert checker.check(EOS, num_output_tokens=3, num_tokens=6) == ("stop", None)
    ignoring = StopChecker(SamplingParams(min_tokens=1, ignore_eos=True), eos_token_ids={EOS})
    assert ignoring.banned_token_ids(0) == []
    assert ignoring.check(EOS, num_output_tokens=1, num_tokens=2) is None


def test_length_ends_at_max_tokens_or_max_model_len():
    checker = StopChecker(SamplingParams(max_tokens=None), max_tokens=3, max_model_len=8)
    assert checker.check(1, num_output_tokens=2, num_tokens=4) is None
    assert checker.check(1, num_output_tokens=3, num_tokens=5) == ("length", None)
    assert checker.check(1, num_output_tokens=1, num_tokens=8) == ("length", None)


def run_text(text: str, params: SamplingParams, stop_token: int | None = None, max_tokens: int = 100):
    """Feed `text`'s tokens (then stop_token, if given) until the checker ends the sequence."""
    tokenizer = make_tiny_tokenizer(320)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), params)
    checker = StopChecker(params, max_tokens=max_tokens, eos_token_ids={EOS}, detokenizer=detokenizer)
    tokens = tokenizer.encode(text) + ([stop_token] if stop_token is not None else [])
    for n, token in enumerate(tokens, start=1):
        stop = checker.check(token, num_output_tokens=n, num_tokens=n + 1)
        if stop is not None:
            return stop, detokenizer.output_text(finished=True)
    return None, detokenizer.output_text(finished=True)


def test_stop_strings_and_the_text_of_stop_tokens():
    assert run_text("the cat sat", SamplingParams(stop=["cat"])) == (("stop", "cat"), "the ")
    # Completed by the last token max_tokens allows: a stop, as in vLLM, not "length".
    last = len(make_tiny_tokenizer(320).encode("the cat"))
    assert run_text("the cat sat", SamplingParams(stop=["cat"]), max_tokens=last) == (("stop", "cat"), "the ")
    assert run_text("the cat sat", SamplingParams(stop=["cat"]), max_tokens=last - 1)[0] == ("length", None)
    # Before min_tokens a stop string does not count.
    assert run_text("ab cd", SamplingParams(stop=["ab"], min_tokens=3)) == (None, "ab cd")
    eos_text = make_tiny_tokenizer(320).decode([EOS])
    assert run_text("hi", SamplingParams(), stop_token=EOS) == (("stop", None), "hi")
    assert run_text("hi", SamplingParams(include_stop_str_in_output=True),
                    stop_token=EOS) == (("stop", None), "hi" + eos_text)
