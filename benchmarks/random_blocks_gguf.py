"""GGUF files at a real model's shape whose quantized blocks are random bytes: start-up and memory at 1.7-8B,
in seconds and without llama.cpp.

make_random_gguf.py makes files whose weights are a real model's quantized by llama.cpp (what speed and
accuracy figures need), but it needs llama.cpp built (10-30 minutes on 2 cores) and holds a float32 model
in memory. Loading, checking, repacking and the self-test cost the same whatever values the blocks hold, so
this writes the blocks directly: the tensor table of llama.cpp's Q4_K_M at the chosen shape (Q4_K matrices,
Q6_K for attn_v and ffn_down in llama.cpp's "more bits" layers and for the output or tied embedding, F32
norms), each block random bytes from a fixed seed with its scales set to small finite float16 values. The
tokenizer and chat template are the default model's (vocabulary 49,152), padded where the shape's vocabulary
is larger with plain reserved tokens (not special ones: a real vocabulary has few, and transformers loads each
special token in Python, seconds for 79k of them). Tensors are written one at a time: nothing the size of the model is
ever in memory. The values are not a trained model's: never use these files for accuracy.

    .venv/bin/python benchmarks/random_blocks_gguf.py [--shape smollm2-1.7b|llama3.1-8b] [--out DIR]

Prints the path; an existing file is kept.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2-1.7b": dict(layers=24, hidden=2048, heads=32, kv_heads=32, ffn=8192, vocab=49152, tied=True,
                         rope_theta=130000.0, context=8192, llama3_rope=False),
    "llama3.1-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False,
                        rope_theta=500000.0, context=131072, llama3_rope=True),
}
# (block weights, block bytes, byte offsets of the float16 scales in a block); MXFP4's one scale is an E8M0 byte
_BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q8_0": (32, 34, (0,)), "MXFP4": (32, 17, ())}
# MXFP4's exponent bytes: 2^(e - 128) times integers up to 12, so weights up to 0.09 (as a trained layer's), and every
# scale within binary16's range (the int8 family packs it exactly there)
_E8M0 = (117, 123)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _tensors(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape (row length first), type) in llama.cpp's order."""
    h, kv_rows, hd = s["hidden"], s["kv_heads"] * (s["hidden"] // s["heads"]), s["hidden"] // s["heads"]
    out = [("token_embd.weight", (h, s["vocab"]), "Q6_K" if s["tied"] else "Q4_K")]
    if s["llama3_rope"]:
        out.append(("rope_freqs.weight", (hd // 2,), "F32"))
    for i in range(s["layers"]):
        more = "Q6_K" if _more_bits(i, s["layers"]) else "Q4_K"
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "F32"), (p + "ffn_down.weight", (s["ffn"], h), more),
                (p + "ffn_gate.weight", (h, s["ffn"]), "Q4_K"), (p + "ffn_up.weight", (h, s["ffn"]), "Q4_K"),
                (p + "ffn_norm.weight", (h,), "F32"), (p + "attn_k.weight", (h, kv_rows), "Q4_K"),
                (p + "attn_output.weight", (h, h), "Q4_K"), (p + "attn_q.weight", (h, h), "Q4_K"),
                (p + "attn_v.weight", (h, kv_rows), more)]
    out.append(("output_norm.weight", (h,), "F32"))
    if not s["tied"]:
        out.append(("output.weight", (h, s["vocab"]), "Q6_K"))
    return out


def _data(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "F32":
        return (1.0 + 0.1 * rng.standard_normal(shape[::-1])).astype(np.float32)
    block, nbytes, scales = _BLOCKS[kind]
    rows, blocks = int(np.prod(shape[1:])), shape[0] // block
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    for at in scales:  # finite, small: the values of a normal-ish weight matrix
        d = (rng.random((rows, blocks), dtype=np.float32) * 2e-3 + 1e-4).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, blocks, 2)
    if kind == "MXFP4":
        raw[:, :, 0] = rng.integers(*_E8M0, (rows, blocks), dtype=np.uint8)
    return raw.reshape(rows, blocks * nbytes)


def _metadata(writer, s: dict, default_gguf: Path) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    """The shape's llama.* keys and the default model's tokenizer, its vocabulary padded to the shape's."""
    tokenizer_metadata(writer, s["vocab"], default_gguf)
    writer.add_name("random blocks")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s["vocab"])
    writer.add_rope_dimension_count(s["hidden"] // s["heads"])
    writer.add_file_type(15)  # MOSTLY_Q4_K_M


def tokenizer_metadata(writer, vocab: int, default_gguf: Path) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    """The default model's tokenizer keys (and quantization version), its vocabulary padded to `vocab` entries."""
    from gguf import GGUFReader, GGUFValueType

    src = GGUFReader(str(default_gguf))
    for field in src.fields.values():
        key = field.name
        if not key.startswith("tokenizer.") and key not in ("general.quantization_version",):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            values = [field.parts[i].tobytes().decode("utf-8") if field.types[1] == GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            extra = vocab - len(values) if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                        "tokenizer.ggml.token_type") else 0
            if extra > 0:
                base = len(values)
                values += ([f"<|reserved_{base + i}|>" for i in range(extra)] if key.endswith("tokens")
                           else [0.0] * extra if key.endswith("scores") else [1] * extra)  # 1: NORMAL
            writer.add_array(key, values)
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, field.parts[field.data[0]].tobytes().decode("utf-8"))
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)


def write(shape: str, out: Path, seed: int = 0) -> Path:
    from gguf import GGUFWriter

    from steadyserve.models.loader import default_model_path

    path = out / f"{shape}-random-blocks-Q4_K_M.gguf"
    if path.exists():
        return path
    s = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), "llama")
    _metadata(writer, s, Path(default_model_path()))
    write_tensors(writer, _tensors(s), seed)
    tmp.rename(path)
    return path


def write_tensors(writer, table: list[tuple[str, tuple[int, ...], str]], seed: int) -> None:  # noqa: ANN001
    """The tensor table's infos, then each tensor's random blocks (_data) one at a time, and close the file: nothing
    the size of the model is in memory. `table`: (name, ggml shape (row length first), type) in file order."""
    from gguf import GGMLQuantizationType

    for name, dims, kind in table:
        qtype = GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor_info(name, dims[::-1], np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            block, nbytes, _ = _BLOCKS[kind]
            row_bytes = dims[0] // block * nbytes  # gguf-py takes a quantized tensor's shape in bytes
            rows = int(np.prod(dims[1:]))  # a 3-D tensor (stacked experts) is its rows of all experts
            shape = (*dims[1:][::-1], row_bytes)
            writer.add_tensor_info(name, shape, np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in table:
        data = _data(dims, kind, rng) if name != "rope_freqs.weight" else np.ones(dims, np.float32)
        writer.write_tensor_data(data)
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    p.add_argument("--out", type=Path, default=Path.home() / ".cache" / "steadyserve" / "bench-models")
    a = p.parse_args()
    print(write(a.shape, a.out))


if __name__ == "__main__":
    main()
