"""Which reader takes a Hugging Face directory's config: the generic one for a directory the installed transformers
wrote (every field its class sets is in config.json), the architecture's class (AutoConfig) for any other, with
the same model either way. The generic reader spares a server start the import of transformers' modelling stack."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = """
import json, sys
from steadyserve.models.loader import load_model
lm = load_model(sys.argv[1])
a = lm.args
print(json.dumps({"arch_module": "transformers.models.llama.configuration_llama" in sys.modules,
                  "args": [a.architecture, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                           a.vocab_size, a.max_position_embeddings, float(a.rms_norm_eps)]}))
"""


def load_in_child(model_dir: str) -> dict:
    p = subprocess.run([sys.executable, "-c", PROBE, model_dir], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_directory_written_by_this_transformers_skips_the_architecture_import(tiny_model: str,
                                                                                tmp_path: Path) -> None:
    same = load_in_child(tiny_model)
    assert not same["arch_module"], "a directory written by the installed transformers imported its config class"
    other = tmp_path / "other-version"
    shutil.copytree(tiny_model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["transformers_version"] = "4.0.0"  # another writer: its class defaults may be missing from the file
    (other / "config.json").write_text(json.dumps(cfg))
    read = load_in_child(str(other))
    assert read["arch_module"], "a directory written by another transformers version must go through AutoConfig"
    assert read["args"] == same["args"]
