"""The `nanovllm` command line (also `python -m nanovllm`): `generate`, `chat`, `serve`, `bench`,
`eval-kl`.

`generate` and `chat` live here. `serve` and `bench` are implemented in their own modules
(`openai_server`, `bench`), imported only when their command runs, each providing
`add_arguments(parser)` and `main(args) -> int`. Any expected failure (a missing model, a bad
flag value, a prompt that does not fit) ends as one `error: ...` line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import sys
import threading
from itertools import count
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any, NoReturn

from nanovllm.entrypoints.engine_args import add_engine_arguments, configure_logging, engine_kwargs

if TYPE_CHECKING:
    from nanovllm import LLM, RequestOutput, SamplingParams

# Commands implemented elsewhere: name -> (module, help).
_PLUGGED_COMMANDS = {
    "serve": ("nanovllm.entrypoints.openai_server", "serve the OpenAI-compatible HTTP API"),
    "bench": ("nanovllm.entrypoints.bench", "run the benchmark workloads"),
    "eval-kl": ("nanovllm.entrypoints.eval_kl", "KL divergence and perplexity against the dense fp32 model"),
}
_EXIT_COMMANDS = ("/exit", "/quit")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse's default prints the whole usage first; one line says it better.
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The first word that is not an option is the command (the top level has no valued options).
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = _build_parser(command).parse_args(argv)
        configure_logging(getattr(args, "log_level", None) or ("info" if command == "serve" else None))
        return args.run(args)
    except (ValueError, OSError) as e:  # OSError covers FileNotFoundError
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `nanovllm` script: main(), then exit without tearing the interpreter down.

    Python's teardown of torch, Inductor and transformers takes ~2 s on a 2-core machine, after
    the answer is printed; everything with something to finish runs before, in the
    interpreter's own order: threading's exit hooks (which stop idle thread pools, such as the
    one Inductor leaves after a first compile) and the join of other non-daemon threads, then
    the exit handlers (tensor-parallel workers are stopped by one), then the output streams are
    flushed."""
    code = main()
    threading._shutdown()  # joining the threads ourselves would wait forever on an idle pool's workers
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say there
            pass
    os._exit(code)


def _build_parser(command: str | None) -> _Parser:
    parser = _Parser(prog="nanovllm", description="nano-vllm: a fast, readable LLM inference engine.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    generate = commands.add_parser("generate", help="complete prompts (one streams, several show a progress bar)",
                                   description="Complete prompts given as arguments, with --file, or on stdin "
                                               "(one per line).")
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete")
    generate.add_argument("--file", metavar="FILE", help="read prompts from FILE, one per line")
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction,
                          help="apply the model's chat template, each prompt being one user message "
                               "(default: on when the model has a template)")
    generate.add_argument("--json", action="store_true",
                          help="print one JSON object per prompt and line: prompt, text, token_ids, finish_reason")
    _add_sampling_arguments(generate)
    add_engine_arguments(generate)
    generate.set_defaults(run=run_generate)

    chat = commands.add_parser("chat", help="talk with the model (Ctrl-D or /exit ends it)",
                               description="An interactive conversation using the model's chat template; "
                                           "replies stream as they are generated. Ctrl-D or /exit ends it.")
    chat.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    _add_sampling_arguments(chat)
    add_engine_arguments(chat)
    chat.set_defaults(run=run_chat)

    for name, (module_name, help_text) in _PLUGGED_COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name == command:  # import only the command that runs: serve pulls in a web stack
            module = _import_command(name, module_name)
            module.add_arguments(sub)
            sub.set_defaults(run=module.main)
    return parser


def _import_command(name: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            reason = f"{module_name} is not part of this installation"
        else:
            reason = f"it needs the module {e.name!r}, which is not installed"
        print(f"error: `nanovllm {name}` is unavailable: {reason}", file=sys.stderr)
        raise SystemExit(2) from None


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=256, metavar="N",
                       help="most tokens to generate per reply (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, metavar="T",
                       help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default: off)")
    group.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K likeliest (default: off)")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from nanovllm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


# ----- generate -----


def run_generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM
    from nanovllm.llm import chat_prompt

    prompts = _read_prompts(args)
    params = _sampling_params(args)  # bad values fail here, before the model loads
    llm = LLM(**engine_kwargs(args))
    tokenizer = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else tokenizer.chat_template is not None
    if use_chat and tokenizer.chat_template is None:
        raise ValueError("the model has no chat template; run with --no-chat")
    inputs = [chat_prompt(llm.get_tokenizer(), [{"role": "user", "content": p}]) if use_chat else p for p in prompts]
    if len(prompts) == 1 and not args.json:
        stream(llm, inputs[0], params, sys.stdout)
        return 0
    outputs = llm.generate(inputs, params, use_tqdm=len(prompts) > 1)  # the bar goes to stderr
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        if args.json:
            record = {"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                      "finish_reason": completion.finish_reason}
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"Prompt: {prompt}\n{completion.text}\n")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts and args.file:
        raise ValueError("give prompts as arguments or with --file, not both")
    if args.prompts:
        return args.prompts
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read prompts from {args.file}: {e.strerror}") from None
        source = args.file
    elif not sys.stdin.isatty():
        lines, source = sys.stdin.read().splitlines(), "stdin"
    else:
        raise ValueError("no prompt given: pass PROMPT arguments, --file FILE, or prompts on stdin")
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {source}")
    return prompts


_request_ids = count()


def stream(llm: LLM, prompt: str | dict[str, Any], params: SamplingParams, out: IO[str]) -> RequestOutput:
    """Generate for one prompt, writing its text to `out` as it grows; returns the final output."""
    engine = llm.llm_engine
    request_id = f"cli-{next(_request_ids)}"
    engine.add_request(request_id, prompt, params)
    written, final = 0, None
    try:
        while final is None:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text  # cumulative: write only what is new
                out.write(text[written:])
                out.flush()
                written = max(written, len(text))
                if output.finished:
                    final = output
    except BaseException:  # Ctrl-C included: free the request's KV blocks
        engine.abort_request(request_id)
        raise
    out.write("\n")
    return final


# ----- chat -----


def run_chat(args: argparse.Namespace) -> int:
    from nanovllm import LLM
    from nanovllm.llm import chat_prompt

    params = _sampling_params(args)
    llm = LLM(**engine_kwargs(args))
    if llm.get_tokenizer().chat_template is None:
        raise ValueError("the model has no chat template; use `nanovllm generate --no-chat`")
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chatting with the model; Ctrl-D or /exit ends the conversation.", file=sys.stderr)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        if line.strip() in _EXIT_COMMANDS:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = stream(llm, chat_prompt(llm.get_tokenizer(), messages), params, sys.stdout)
        except ValueError as e:  # e.g. the history outgrew max_model_len: say so, keep the session
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply.outputs[0].text})
    if interactive:
        print(file=sys.stderr)
    return 0

