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


# ---- nothing above the engine reaches into it; each limit is read from its one owner ----------------------------
# Import contracts cannot see attribute chains, so these are read from the syntax tree of every module above the
# engine (the API and the command line): the engine's inside (`state.engine.engine.…`, its cache, scheduler,
# grammar compiler) is the engine's, and the model's limits are read from ModelLimits (ServerState.limits, built
# once by the engine), never again from the loaded model or the engine.
# api/startup.py is exempt: it builds the engine (and from it the ModelLimits the rest is handed).
ABOVE_THE_ENGINE = [*sorted(p for p in (ROOT / "src/steadyserve/api").rglob("*.py") if p.name != "startup.py"),
                    ROOT / "src/steadyserve/cli.py"]
ENGINE_INSIDE = {"engine", "kv", "block_manager", "scheduler", "runner", "grammars", "eos_token_ids", "speculator"}
LIMIT_OWNED = {"max_model_len": "limits.context", "vocab_size": "limits.vocab_size"}  # attr -> where to read it


def reaches_in(source: str, name: str) -> list[str]:
    """Each `engine.engine`-like reach and each limit read past ModelLimits in `source`, as 'name:line: what'."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        inner_name = inner.attr if isinstance(inner, ast.Attribute) else inner.id if isinstance(inner, ast.Name) \
            else ""
        if inner_name == "engine" and node.attr in ENGINE_INSIDE:
            found.append(f"{name}:{node.lineno}: .engine.{node.attr} reaches into the engine")
        if node.attr in LIMIT_OWNED and inner_name != "limits":
            found.append(f"{name}:{node.lineno}: .{inner_name}.{node.attr}: read {LIMIT_OWNED[node.attr]}")
    return found


def test_nothing_above_the_engine_reaches_into_it() -> None:
    found = [f for path in ABOVE_THE_ENGINE for f in reaches_in(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_a_reach_into_the_engine_is_found() -> None:
    """The same scan on code that does what api/ and cli.py used to (state.engine.engine.grammars, the KV
    cache's blocks, the context read off the loaded model)."""
    source = ("g = state.engine.engine.grammars\nn = state.engine.engine.kv.num_blocks\n"
              "c = state.loaded.max_model_len\nv = state.loaded.args.vocab_size\nok = state.limits.context\n")
    found = reaches_in(source, "x.py")
    assert sorted({int(f.split(":")[1]) for f in found}) == [1, 2, 3, 4], found
