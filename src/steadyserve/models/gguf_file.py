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

The file is untrusted input (llama.cpp has had heap overflows in its GGUF parser): every count is checked
against the bytes left before anything is read or allocated for it, every tensor against the file's end,
and each refusal is a GgufFormatError naming the field or the tensor (tests/test_gguf_fuzz.py).
"""

from __future__ import annotations

import math
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
_MAX_DIMS = 4  # GGML_MAX_DIMS: no ggml tensor has more
_MAX_NESTING = 4  # arrays of arrays: no known writer nests them; the bound keeps recursion far from Python's limit
# the fewest bytes one entry can take, to bound a count by the bytes left before looping over it:
_MIN_KV = 8 + 4 + 1  # key length, value type, a one-byte value (its key may be empty)
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, type, offset
_MIN_STRING = 8  # its length
_MIN_ARRAY = 4 + 8  # item type, count
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

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class GgufFile:
    """metadata: key -> value (str, int, float, bool; numeric arrays as lists, string arrays as their length);
    tensors in file order; data: the read-only memory mapping the tensors are views of."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    data: np.ndarray  # a numpy memmap (an empty array for an empty file, which cannot be mapped)
    alignment: int = _DEFAULT_ALIGNMENT
    data_start: int = 0  # the tensor data section: the header's end, padded to the alignment


class GgufFormatError(ValueError):
    """The file is not a well-formed GGUF; str() names the field or tensor at fault."""


class _Cursor:
    """Reads little-endian values from the header's bytes, advancing an offset; `where` says what is being read,
    for the error when the file ends first. `text`: the strings of string arrays are checked as UTF-8 too."""

    def __init__(self, buf: memoryview, text: bool) -> None:
        self.buf, self.offs, self.where, self.text = buf, 0, "the header", text

    def unpack(self, fmt: str) -> Any:
        self.need(struct.calcsize(fmt))
        (value,) = struct.unpack_from(fmt, self.buf, self.offs)
        self.offs += struct.calcsize(fmt)
        return value

    def left(self) -> int:
        return len(self.buf) - self.offs

    def need(self, n: int) -> None:
        if n > self.left():  # a slice would come back short instead of failing
            raise GgufFormatError(f"{self.where} runs past the end of the file ({len(self.buf)} bytes): truncated")

    def count(self, n: int, each: int, what: str) -> int:
        """n entries of at least `each` bytes: refused unless the rest of the file can hold them (checked before
        any loop or allocation over n, so that a damaged count is an error, not a hang or a MemoryError)."""
        if n * each > self.left():
            raise GgufFormatError(f"{self.where}: {what} {n} cannot fit in the {self.left()} bytes left of the "
                                  f"file ({each} or more bytes each): the count is wrong, or the file truncated")
        return n

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n)
        raw = bytes(self.buf[self.offs:self.offs + n])
        self.offs += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufFormatError(f"{self.where}: a string of {n} bytes that is not UTF-8") from None

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == GGUFValueType.ARRAY:
            return self.array(depth + 1)
        raise GgufFormatError(f"{self.where}: unknown value type {kind}")

    def array(self, depth: int) -> Any:
        if depth > _MAX_NESTING:
            raise GgufFormatError(f"{self.where}: arrays nested more than {_MAX_NESTING} deep")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item == GGUFValueType.STRING:  # skipped by their lengths: nothing here reads the strings
            buf, offs, end = self.buf, self.offs, len(self.buf)
            for i in range(self.count(count, _MIN_STRING, "an array of strings, count")):
                if offs + 8 > end:
                    offs = end + 1
                    break
                n = struct.unpack_from("<Q", buf, offs)[0]
                if self.text and offs + 8 + n <= end:
                    try:
                        bytes(buf[offs + 8:offs + 8 + n]).decode("utf-8")
                    except UnicodeDecodeError:
                        raise GgufFormatError(f"{self.where}: string {i} of {count} is not UTF-8") from None
                offs += 8 + n
            self.offs = min(offs, end + 1)  # past the end when the strings were: need() says so
            self.need(0)
            return count
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
            self.count(count, dtype.itemsize, f"an array of {GGUFValueType(item).name}, count")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offs)
            self.offs += values.nbytes
            return values.tolist()
        if item == GGUFValueType.ARRAY:  # arrays of arrays (no known file writes them)
            return [self.value(item, depth) for _ in range(self.count(count, _MIN_ARRAY, "an array of arrays, count"))]
        raise GgufFormatError(f"{self.where}: an array of unknown value type {item}")


def read_gguf(path: str | Path, text: bool = False) -> GgufFile:
    """The file's metadata and tensors; GgufFormatError (a ValueError) naming the field or tensor for a file that is
    not a GGUF of version 2 or 3, is cut short, or whose counts, types or offsets cannot be right. `text`: check
    that every string of every string array (the vocabulary, the merges) is UTF-8, as the tokenizer's conversion
    will read them (~0.1 s for Gemma 3's 262k tokens: worth it before a conversion, not at every start)."""
    data = np.memmap(str(path), mode="r") if Path(path).stat().st_size else np.zeros(0, np.uint8)
    return _parse(data, text)


def _parse(data: np.ndarray, text: bool = False) -> GgufFile:
    cur = _Cursor(memoryview(data), text)
    magic = cur.unpack("<I")
    if magic != GGUF_MAGIC:
        raise GgufFormatError(f"GGUF magic invalid: {struct.pack('<I', magic)!r}, expected b'GGUF'")
    version = cur.unpack("<I")
    if version not in _SUPPORTED_VERSIONS:  # includes big-endian files, which gguf-py's writer rarely makes
        raise GgufFormatError(f"GGUF version {version} (or a big-endian file) is not supported (2 or 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    cur.count(n_kv, _MIN_KV, "the metadata key count")
    cur.count(n_tensors, _MIN_TENSOR_INFO, "the tensor count")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        cur.where = f"metadata key {i} of {n_kv}"
        key = cur.string()
        cur.where = f"metadata key {key!r}"
        if key in metadata:
            raise GgufFormatError(f"metadata key {key!r} appears twice")
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for i in range(n_tensors):
        cur.where = f"tensor info {i} of {n_tensors}"
        name = cur.string()
        cur.where = f"tensor {name!r}"
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GgufFormatError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise GgufFormatError(f"metadata key 'general.alignment' is {alignment!r}: must be a power of two")
    start = -(-cur.offs // alignment) * alignment
    tensors, names = [], set()
    for info in infos:
        if info[0] in names:
            raise GgufFormatError(f"tensor {info[0]!r} appears twice")
        names.add(info[0])
        tensors.append(_tensor(data, start, alignment, *info))
    return GgufFile(metadata, tensors, data, alignment, start)


def _tensor(data: np.ndarray, start: int, alignment: int, name: str, dims: tuple[int, ...], raw_type: int,
            rel: int) -> GgufTensor:
    """One tensor's view of the mapping, built as GGUFReader's _build_tensors builds it, once its type is known,
    its rows hold whole blocks and its bytes lie inside the file at an aligned offset."""
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise GgufFormatError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
    block, type_size = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise GgufFormatError(f"tensor {name!r} has rows of {dims[0]} values: not whole {kind.name} blocks of {block}")
    n_elems = math.prod(dims)  # Python integers: a damaged dimension cannot overflow
    nbytes = n_elems // block * type_size
    offs = start + rel
    if rel % alignment:
        raise GgufFormatError(f"tensor {name!r} has data offset {rel}: not a multiple of the alignment {alignment}")
    if offs + nbytes > data.size:
        raise GgufFormatError(f"tensor {name!r} ({kind.name}, shape {dims}, {nbytes} bytes at {offs}) runs past the "
                              f"end of the file ({data.size} bytes): truncated, or its shape, type or offset is wrong")
    np_dims: tuple[int, ...] = tuple(reversed(dims))
    item = _PLAIN_TENSORS.get(kind)
    if item is None:
        item, count, np_dims = np.uint8, nbytes, quant_shape_to_byte_shape(np_dims, kind)
    else:
        count = n_elems
    view = data[offs:offs + nbytes].view(item)[:count].reshape(np_dims)
    return GgufTensor(name, kind, dims, offs, view)


def check_layout(f: GgufFile) -> None:
    """llama.cpp's rule (gguf.cpp): each tensor's data starts where the one before it ends, padded to the
    alignment. A type or a shape changed in the table moves every later tensor's expected start, so a damaged
    entry that still lies inside the file is found here rather than read as other values."""
    expected = f.data_start
    before: GgufTensor | None = None
    for t in f.tensors:
        if t.data_offset != expected:
            after = f"the end of tensor {before.name!r} ({before.tensor_type.name}, shape {before.shape}, " \
                    f"{before.nbytes} bytes)" if before is not None else "the start of the data"
            raise GgufFormatError(f"tensor {t.name!r} starts at byte {t.data_offset}, but {after} is at {expected}: "
                                  "the type, shape or offset of one of them is wrong")
        expected = t.data_offset + -(-t.nbytes // f.alignment) * f.alignment
        before = t
