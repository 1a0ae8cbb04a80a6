"""Reading checkpoint tensors from an HF model directory's safetensors files."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's files: those named by the shard index if there is one, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX
    if index.exists():
        # The index decides: a directory may also hold another copy (e.g. consolidated.safetensors).
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are absent: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if any(p.suffix in _PICKLE_SUFFIXES for p in model_dir.iterdir()):
        raise ValueError(f"{model_dir} holds only pickle checkpoints (*.bin/*.pt); safetensors are required "
                         "(pickle files can run code when loaded). Convert the checkpoint to *.safetensors.")
    raise FileNotFoundError(f"no *.safetensors files in {model_dir}")


def matrix_names(model_dir: str | Path) -> list[str]:
    """Names of the checkpoint's 2-D tensors, from the files' headers."""
    names = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names += [name for name in f.keys() if len(f.get_slice(name).get_shape()) == 2]
    return names


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of the checkpoint, one file at a time."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # truncated or corrupt: say which file
            raise ValueError(f"cannot read the checkpoint file {path}: {e}") from None
