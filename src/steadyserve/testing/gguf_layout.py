"""Where each field of a GGUF file lies, so that a test can damage exactly one of them.

The loader's own reader (models/gguf_file.py) is what the damage tests check, so this map is written
separately from it, from the format's description (gguf-py's GGUFWriter is the writer of the files it
reads): a header (magic, version, tensor count, key count), the metadata keys and values, the tensor
infos (name, dimension count, dimensions in ggml order, type, data offset relative to the aligned data
section) and the data. Each field is a `Slot`: its byte offset and struct format, so that `patch` can
write another value of the same width there and leave every other byte as it was.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

# gguf-py's GGUFValueType: the fixed-width scalar types and their struct formats
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Slot:
    """One fixed-width field: where it starts and how it is packed."""

    offset: int
    fmt: str

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)


@dataclass
class KvLayout:
    key: str
    key_length: Slot  # the uint64 length before the key's bytes
    value_type: Slot
    value: Slot | None  # a scalar's value; None for strings and arrays
    item_type: Slot | None = None  # arrays: their items' type and count
    count: Slot | None = None
    end: int = 0  # the byte after the value


@dataclass
class TensorLayout:
    name: str
    name_length: Slot
    n_dims: Slot
    dims: list[Slot]
    tensor_type: Slot
    data_offset: Slot  # relative to the start of the data section
    start: int = 0  # the first byte of this tensor's info


@dataclass
class GgufLayout:
    magic: Slot
    version: Slot
    n_tensors: Slot
    n_kv: Slot
    kvs: dict[str, KvLayout] = field(default_factory=dict)
    tensors: dict[str, TensorLayout] = field(default_factory=dict)
    infos_start: int = 0  # the first tensor info
    infos_end: int = 0  # the byte after the last tensor info
    data_start: int = 0  # the aligned start of the tensor data


def layout(raw: bytes) -> GgufLayout:
    """The map of a well-formed GGUF file (version 3, little-endian), as gguf-py writes one."""
    offs = 0

    def take(fmt: str) -> tuple[Slot, Any]:
        nonlocal offs
        slot = Slot(offs, fmt)
        offs += slot.size
        return slot, struct.unpack_from(fmt, raw, slot.offset)[0]

    def string() -> tuple[Slot, str]:
        nonlocal offs
        slot, n = take("<Q")
        text = raw[offs:offs + n].decode("utf-8")
        offs += n
        return slot, text

    def skip_value(kind: int) -> None:
        nonlocal offs
        if kind == _STRING:
            string()
        elif kind == _ARRAY:
            _, item = take("<I")
            _, count = take("<Q")
            for _ in range(count):
                skip_value(item)
        else:
            offs += struct.calcsize(_SCALAR_FORMATS[kind])

    magic, _ = take("<I")
    version, _ = take("<I")
    n_tensors_slot, n_tensors = take("<Q")
    n_kv_slot, n_kv = take("<Q")
    out = GgufLayout(magic, version, n_tensors_slot, n_kv_slot)
    alignment = 32
    for _ in range(n_kv):
        key_length, key = string()
        type_slot, kind = take("<I")
        kv = KvLayout(key, key_length, type_slot, None)
        if kind == _ARRAY:
            kv.item_type, item = take("<I")
            kv.count, count = take("<Q")
            for _ in range(count):
                skip_value(item)
        elif kind == _STRING:
            string()
        else:
            kv.value, value = take(_SCALAR_FORMATS[kind])
            if key == "general.alignment":
                alignment = value
        kv.end = offs
        out.kvs[key] = kv
    out.infos_start = offs
    for _ in range(n_tensors):
        start = offs
        name_length, name = string()
        n_dims_slot, n_dims = take("<I")
        dims = [take("<Q")[0] for _ in range(n_dims)]
        type_slot, _ = take("<I")
        offset_slot, _ = take("<Q")
        out.tensors[name] = TensorLayout(name, name_length, n_dims_slot, dims, type_slot, offset_slot, start)
    out.infos_end = offs
    out.data_start = -(-offs // alignment) * alignment
    return out


def read(raw: bytes, slot: Slot) -> int | float:
    return struct.unpack_from(slot.fmt, raw, slot.offset)[0]


def patch(raw: bytes, slot: Slot, value: int | float) -> bytes:
    """raw with `value` packed into `slot` (an integer wraps to the slot's width, as a damaged byte would)."""
    if slot.fmt[-1] in "BHIQ":
        value = int(value) % (1 << (8 * slot.size))
    elif slot.fmt[-1] in "bhiq":
        bits = 8 * slot.size
        value = (int(value) + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    elif slot.fmt[-1] == "?":
        value = bool(value)
    buf = bytearray(raw)
    struct.pack_into(slot.fmt, buf, slot.offset, value)
    return bytes(buf)
