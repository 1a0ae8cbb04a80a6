"""Imports point down (docs/ARCHITECTURE.md): no cycle between nanovllm's subpackages and
top-level modules, and the model side (layers, models, attention) imports nothing from the
engine or the entry points. Read from the source, function-level imports included; a package's
`__main__.py` is a command, which nothing imports, and is left out. And a machine without the
packages only some features need (gguf for GGUF files, llguidance for structured outputs; the
GPU machine's image has neither) runs a Hugging Face checkpoint. Importing nanovllm before torch
makes torch's OpenMP threads passive, unless the user chose a policy."""

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nanovllm
from conftest import make_tiny_checkpoint

ROOT = Path(nanovllm.__file__).parent
MODEL_SIDE = ("nanovllm.layers", "nanovllm.models", "nanovllm.attention")
ABOVE_THE_MODEL = ("nanovllm.engine", "nanovllm.entrypoints")


def _unit(module: str) -> str:
    """nanovllm.engine.scheduler -> nanovllm.engine; nanovllm.config -> nanovllm.config."""
    return ".".join(module.split(".")[:2])


def _imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            for alias in node.names:  # `from nanovllm import llm` imports a module
                candidate = Path(ROOT.parent, *node.module.split("."), alias.name)
                if candidate.with_suffix(".py").exists() or candidate.is_dir():
                    found.add(f"{node.module}.{alias.name}")
    return {m for m in found if m == "nanovllm" or m.startswith("nanovllm.")}


def _dependencies() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        unit = _unit(module)
        deps = {_unit(m) for m in _imported_modules(ast.parse(path.read_text()))} - {unit}
        graph.setdefault(unit, set()).update(deps)
    return graph


def test_no_cycle_between_subpackages():
    try:
        list(graphlib.TopologicalSorter(_dependencies()).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle between nanovllm's parts: {' -> '.join(e.args[1])}")


def test_the_model_side_imports_nothing_above_it():
    graph = _dependencies()
    wrong = {unit: sorted(graph.get(unit, set()) & set(ABOVE_THE_MODEL)) for unit in MODEL_SIDE}
    assert not any(wrong.values()), f"imports from the engine or entry points: {wrong}"


WITHOUT_OPTIONAL_PACKAGES = """
import sys
sys.modules["gguf"] = sys.modules["llguidance"] = None  # any import of them fails
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.entrypoints import cli  # the command line's modules too
llm = LLM(sys.argv[1], dtype="float32", num_kvcache_blocks=16, max_model_len=64, enforce_eager=True)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
assert len(out.outputs[0].token_ids) == 4
try:
    llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), use_tqdm=False)
except ValueError as e:
    assert "pip install llguidance" in str(e), e
else:
    raise AssertionError("a constraint ran without llguidance")
assert "gguf" not in sys.modules or sys.modules["gguf"] is None
print("ran")
"""


def test_hf_checkpoints_run_without_gguf_and_llguidance(tmp_path):
    path = make_tiny_checkpoint(tmp_path)
    result = subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL_PACKAGES, str(path)], capture_output=True,
                            text=True, timeout=300, cwd=ROOT.parent)
    assert result.returncode == 0 and result.stdout.strip().endswith("ran"), result.stderr[-3000:]


@pytest.mark.parametrize("given,expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_nanovllm_first_makes_openmp_threads_passive(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    script = "import os, nanovllm, torch; print(os.environ['OMP_WAIT_POLICY'])"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected
