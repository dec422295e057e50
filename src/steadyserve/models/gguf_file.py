"""A GGUF file's metadata and tensor table, read in one pass over the header: what gguf-py's GGUFReader
gives (the tensors as numpy views of a memory mapping, the same types and shapes), without its cost.

GGUFReader makes a numpy memmap view for every part of every metadata value: for Gemma 3's 262k-token
vocabulary (tokens, scores, token types) that is about 4 million views and 19 s of one core at every
server start, for values the server never reads (the tokenizer comes from the converted HF directory).
Here the header is walked with struct over the mapping's bytes: string arrays are skipped by their
lengths (kept as a count, as gguf_config.read_metadata has always left them), numeric arrays are one
numpy read each, and only the tensor data become views of the mapping, built exactly as GGUFReader's
_build_tensors builds them, so that gguf-py's dequantize and our QWeight read the same bytes.
tests/test_gguf_file.py checks both readers agree on real files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = 0x46554747  # b"GGUF" read little-endian
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# scalar value types: struct format (little-endian) and numpy dtype
_SCALARS: dict[int, tuple[str, Any]] = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64), GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}
# unquantized tensor types are read as their element type, as GGUFReader does; the others as bytes
_PLAIN_TENSORS = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor, with the fields of gguf-py's ReaderTensor that steadyserve reads."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    data_offset: int  # absolute, in the file
    data: np.ndarray  # a view of GgufFile.data: element type, or uint8 bytes for block formats


@dataclass
class GgufFile:
    """metadata: key -> value (str, int, float, bool; numeric arrays as lists, string arrays as their length);
    tensors in file order; data: the read-only memory mapping the tensors are views of."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    data: np.memmap


class _Cursor:
    """Reads little-endian values from the header's bytes, advancing an offset."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.offs = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.offs)
        self.offs += struct.calcsize(fmt)
        return value

    def need(self, n: int) -> None:
        if self.offs + n > len(self.buf):  # a slice would come back short instead of failing
            raise struct.error(f"{n} bytes at {self.offs}")

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        s = bytes(self.buf[self.offs:self.offs + n]).decode("utf-8")
        self.offs += n
        return s

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == GGUFValueType.ARRAY:
            return self.array()
        raise ValueError(f"GGUF: unknown metadata value type {kind} at byte {self.offs}")

    def array(self) -> Any:
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item == GGUFValueType.STRING:  # skipped by their lengths: nothing here reads the strings
            buf, offs = self.buf, self.offs
            for _ in range(count):
                offs += 8 + struct.unpack_from("<Q", buf, offs)[0]
            self.offs = offs
            self.need(0)  # the last string's bytes are inside the file
            return count
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            self.need(dtype.itemsize * count)
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offs)
            self.offs += values.nbytes
            return values.tolist()
        return [self.value(item) for _ in range(count)]  # arrays of arrays (no known file writes them)


def read_gguf(path: str | Path) -> GgufFile:
    """The file's metadata and tensors; ValueError for a file that is not a GGUF of version 2 or 3, or is cut
    short (a header or a tensor running past the end of the file)."""
    data = np.memmap(str(path), mode="r")
    try:
        return _parse(data)
    except struct.error:  # struct's own words ("requires a buffer of at least ...") do not say what is wrong
        raise ValueError(f"GGUF header runs past the end of the file ({data.size} bytes): truncated") from None


def _parse(data: np.memmap) -> GgufFile:
    cur = _Cursor(memoryview(data))
    if cur.unpack("<I") != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    version = cur.unpack("<I")
    if version not in _SUPPORTED_VERSIONS:  # includes big-endian files, which gguf-py's writer rarely makes
        raise ValueError(f"GGUF version {version} (or a big-endian file) is not supported")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise KeyError(f"Duplicate {key} in the GGUF metadata")
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"Invalid alignment {alignment}: must be a non-zero power of two")
    start = -(-cur.offs // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, rel in infos:
        if name in names:
            raise ValueError(f"Found duplicated tensor with name {name}")
        names.add(name)
        kind = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims))
        np_dims: tuple[int, ...] = tuple(reversed(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        item = _PLAIN_TENSORS.get(kind)
        if item is None:
            item, count, np_dims = np.uint8, n_elems * type_size // block, quant_shape_to_byte_shape(np_dims, kind)
        else:
            count = n_elems
        offs = start + rel
        if offs + np.dtype(item).itemsize * count > data.size:
            raise ValueError(f"GGUF tensor {name} runs past the end of the file ({data.size} bytes): truncated")
        view = data[offs:offs + np.dtype(item).itemsize * count].view(item)[:count].reshape(np_dims)
        tensors.append(GgufTensor(name, kind, dims, offs, view))
    return GgufFile(metadata, tensors, data)
