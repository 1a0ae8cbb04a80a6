"""A small reader of a GGUF file's header: its scalar and string metadata, and where each tensor's
data lies in the file's memory map.

`gguf.GGUFReader` builds a numpy view of every field, one element at a time, including each of
the tokenizer's tens of thousands of vocabulary strings and merges: seconds on every start-up.
This walks the header once with `struct`, skipping arrays of strings and long arrays (the
tokenizer reads those itself) but keeping short arrays of numbers (a value a layer, such as which
layers slide), and gives tensors the same data views as gguf-py's reader (the format's layout;
gguf stays the reference in the tests).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
# Tensor types whose data gguf-py hands out as typed elements; the others as raw block bytes.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (GGUF lists dims innermost first)
    data: np.ndarray  # a read-only view of the file's memory map, as gguf-py's reader gives it


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # scalar and string fields
    tensors: dict[str, TensorInfo]


_U64 = struct.Struct("<Q")
# Arrays of numbers up to this long are read as lists (per-layer settings); longer ones skipped.
_MAX_READ_ARRAY = 4096


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        text = bytes(self.buffer[self.offset:self.offset + length]).decode("utf-8")
        self.offset += length
        return text

    def short_number_array(self) -> list | None:
        """At an array's value: a short array of numbers as a list; else None, the cursor left there."""
        element_type, count = GGUFValueType(struct.unpack_from("<I", self.buffer, self.offset)[0]), \
            struct.unpack_from("<Q", self.buffer, self.offset + 4)[0]
        if element_type not in _SCALARS or count > _MAX_READ_ARRAY:
            return None
        self.offset += 12
        return [self.unpack(_SCALARS[element_type]) for _ in range(count)]

    def skip_value(self, value_type: GGUFValueType) -> None:
        if value_type == GGUFValueType.STRING:
            length = self.unpack("Q")  # (not `offset += unpack()`: that adds to the offset before it)
            self.offset += length
        elif value_type == GGUFValueType.ARRAY:
            element_type, count = GGUFValueType(self.unpack("I")), self.unpack("Q")
            if element_type in _SCALARS:
                self.offset += count * struct.calcsize(_SCALARS[element_type])
            elif element_type == GGUFValueType.STRING:  # a vocabulary: ~100k strings, in one tight loop
                offset, length_at = self.offset, _U64.unpack_from
                for _ in range(count):
                    offset += 8 + length_at(self.buffer, offset)[0]
                self.offset = offset
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            self.offset += struct.calcsize(_SCALARS[value_type])


def read_gguf_header(path: str) -> GGUFHeader:
    """Raises ValueError for a file that is not a little-endian GGUF of version 2 or 3."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, mapped)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _parse(path: str, mapped: mmap.mmap) -> GGUFHeader:
    cursor = _Cursor(memoryview(mapped))
    if bytes(cursor.buffer[:4]) != _MAGIC:
        raise ValueError("it does not start with the GGUF magic")
    cursor.offset = 4
    version = cursor.unpack("I")
    if version not in (2, 3):
        swapped = struct.unpack(">I", struct.pack("<I", version))[0]
        if swapped in (2, 3):
            raise ValueError("big-endian GGUF files are not supported")
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cursor.unpack("QQ")
    metadata: dict[str, Any] = {}
    for _ in range(num_fields):
        name, value_type = cursor.string(), GGUFValueType(cursor.unpack("I"))
        if value_type == GGUFValueType.STRING:
            metadata[name] = cursor.string()
        elif value_type in _SCALARS:
            metadata[name] = cursor.unpack(_SCALARS[value_type])
        elif value_type == GGUFValueType.ARRAY and (array := cursor.short_number_array()) is not None:
            metadata[name] = array
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
        infos.append((name, dims, GGMLQuantizationType(cursor.unpack("I")), cursor.unpack("Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, tensor_type, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        shape = tuple(reversed(dims))
        n_elements = int(np.prod(dims))
        if tensor_type in _ELEMENT_TYPES:
            dtype, count, view_shape = _ELEMENT_TYPES[tensor_type], n_elements, shape
        else:
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            dtype, count = np.uint8, n_elements * type_size // block_size
            view_shape = quant_shape_to_byte_shape(shape, tensor_type)
        data = np.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + offset).reshape(view_shape)
        tensors[name] = TensorInfo(name, tensor_type, shape, data)
    return GGUFHeader(metadata, tensors)
