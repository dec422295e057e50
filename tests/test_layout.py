"""The layering the architecture promises, checked by a real tool: import-linter's contracts in pyproject.toml
(the engine, models and kernels never import the front ends; HTTP and gRPC never import each other; the HTTP API
never imports the web console, which the server mounts; model modules never import the registry; the tools
never import the command line; no import cycles among the top-level modules of the package, nor among the modules
of api, api.http, models and engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([LINT, "--no-cache", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_contracts_are_kept() -> None:
    res = lint()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout and "9 kept" in res.stdout


def test_the_linter_reports_a_broken_contract(tmp_path) -> None:
    """The same tool, with a contract the code breaks on purpose (the HTTP front end does import the engine)."""
    cfg = tmp_path / "contracts.toml"
    cfg.write_text('[tool.importlinter]\nroot_package = "steadyserve"\n\n[[tool.importlinter.contracts]]\n'
                   'name = "deliberately broken"\ntype = "forbidden"\nsource_modules = ["steadyserve.api.http"]\n'
                   'forbidden_modules = ["steadyserve.engine"]\n')
    res = lint("--config", str(cfg))
    assert res.returncode != 0 and "BROKEN" in res.stdout.upper(), res.stdout[-2000:]
