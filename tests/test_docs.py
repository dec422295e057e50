"""The documentation site: it builds in strict mode, its references cover everything, its snippets run.

* `mkdocs build --strict` (what `make docs` runs): a broken link, a missing page or anchor, or a
  generator that finds something undocumented fails the build.
* The generators (docs/docgen.py, a build script outside the package) cover every flag, route, rpc, metric and alert, and fail
  when one lacks its documentation: each is shown failing on a deliberately undocumented item.
* Every ```sh and ```python block of the quickstart and the guides runs against a live server (the tiny
  model on ephemeral ports; `localhost:8000` and `localhost:50051` are rewritten to it) and must exit 0.
  ```console blocks are transcripts of commands the suite cannot run here (they start servers, take
  minutes, or need Docker, Kubernetes or a Ray cluster); each of their commands must be on ALLOWED_UNRUN.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))  # docgen.py is a build script there, outside the installed package
import docgen  # noqa: E402
from docgen import Undocumented  # noqa: E402
GUIDES = ["quickstart.md", "concepts.md", "operations.md", "deploy.md", "benchmarks.md", "troubleshooting.md",
          "runbooks.md", "tracing.md", "embeddings.md", "messages.md", "tenants.md"]
# Commands that start servers, take minutes, need Docker or Kubernetes, or fetch tasks from a hub.
ALLOWED_UNRUN = ("make ", "docker ", "kubectl ", "serve ", "ray ", ".venv/bin/python benchmarks/", ".venv/bin/pip ", "lm_eval ",
                 "benchmarks/build_llama_cpp.sh")
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}  # banners about MkDocs 2, as in Makefile
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)


def test_site_builds_in_strict_mode(tmp_path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, **QUIET}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for page, needle in (("reference/cli/index.html", "--kv-cache-memory"),
                         ("reference/http/index.html", "/v1/chat/completions"),
                         ("reference/grpc/index.html", "GenerateRequest"),
                         ("reference/metrics/index.html", "steadyserve_requests_rejected_total"),
                         ("reference/alerts/index.html", "SteadyserveEngineDead"),
                         ("runbooks/index.html", 'id="steadyserveenginedead"')):
        assert needle in (site / page).read_text(), f"{page} lacks {needle}"


# ---- generated references: complete, and failing on a gap ------------------------------------------------------

def serve_flags() -> list[str]:
    from steadyserve.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return [o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"]


def test_cli_reference_lists_every_serve_flag_with_its_constraints() -> None:
    page = docgen.cli_reference()
    for flag in serve_flags():
        assert f"`{flag}`" in page, flag
    row = next(line for line in page.splitlines() if line.startswith("| `--block-size`"))
    assert "engine.block_size" in row and "--block-size must be in 1..1024" in row
    row = next(line for line in page.splitlines() if line.startswith("| `--numerics`"))
    assert "`portable`" in row and "engine.numerics" in row


def test_cli_reference_fails_on_a_flag_without_help_or_config_field(monkeypatch) -> None:
    import steadyserve.cli as cli

    real = cli.build_parser

    def with_extra() -> argparse.ArgumentParser:
        p = real()
        p._subparsers._group_actions[0].choices["serve"].add_argument("--mystery", default=1)  # type: ignore[union-attr]
        return p

    monkeypatch.setattr(cli, "build_parser", with_extra)
    with pytest.raises(Undocumented) as e:
        docgen.cli_reference()
    assert "--mystery: no help text" in str(e.value) and "--mystery: no config field" in str(e.value)


def test_http_reference_covers_every_route_and_field_and_marks_extensions() -> None:
    from fastapi.routing import APIRoute
    from starlette.routing import WebSocketRoute

    page = docgen.http_reference()
    app = docgen.build_http_app()
    for route in app.routes:
        if isinstance(route, APIRoute) and route.include_in_schema:
            for method in route.methods:
                assert f"`{method} {route.path}`" in page
        elif isinstance(route, WebSocketRoute):
            assert f"`WebSocket {route.path}`" in page
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        assert f"**{model}**" in page
    top_k = next(line for line in page.splitlines() if line.startswith("| `top_k`"))
    assert "**extension**" in top_k
    temp = next(line for line in page.splitlines() if line.startswith("| `temperature`"))
    assert "≥ 0.0" in temp and "≤ 2.0" in temp and "**extension**" not in temp


class Body(BaseModel):
    """A request body whose field has no description."""
    x: int


def test_http_reference_fails_on_an_undocumented_route_or_field(monkeypatch) -> None:
    real = docgen.build_http_app

    def with_gap():
        app = real()

        @app.post("/v1/undocumented")
        async def undocumented(body: Body) -> dict:
            return {}

        app.openapi_schema = None
        return app

    monkeypatch.setattr(docgen, "build_http_app", with_gap)
    with pytest.raises(Undocumented) as e:
        docgen.http_reference()
    assert "POST /v1/undocumented: no docstring" in str(e.value) and "Body.x: no description" in str(e.value)


def test_grpc_reference_covers_every_rpc_message_and_field() -> None:
    page = docgen.grpc_reference()
    proto = (ROOT / "proto/steadyserve/v1/inference.proto").read_text()
    for rpc in re.findall(r"^\s*rpc (\w+)\(", proto, re.M):
        assert f"rpc {rpc}(" in page
    for msg in re.findall(r"^\s*message (\w+) \{", proto, re.M):
        assert f"`{msg}`" in page or f".{msg}`" in page, msg


def test_grpc_reference_fails_on_an_uncommented_field(tmp_path, monkeypatch) -> None:
    src = (ROOT / "proto/steadyserve/v1/inference.proto").read_text()
    broken = re.sub(r"(message ScoreResponse \{\n(?:.*\n)*?)(\s*//[^\n]*\n)(\s*string request_id = 1;)", r"\1\3",
                    src, count=1)
    assert broken != src
    path = tmp_path / "steadyserve" / "v1" / "inference.proto"
    path.parent.mkdir(parents=True)
    path.write_text(broken)
    monkeypatch.setattr(docgen, "ROOT", tmp_path)
    with pytest.raises(Undocumented, match=r"ScoreResponse\.request_id"):
        docgen.grpc_reference(path)


def test_metrics_reference_lists_every_exported_metric(monkeypatch) -> None:
    from steadyserve.metrics import Metrics

    page = docgen.metrics_reference()
    m = Metrics("model", "fp", "cpu", "float32", True)
    names = {line.split()[2] for line in m.render().decode().splitlines()
             if line.startswith("# TYPE") and not line.split()[2].endswith("_created")}  # counters' start times
    assert len(names) > 30
    for name in names:
        assert f"`{name}`" in page or f"`{name}_total`" in page, name
    real_init = Metrics.__init__

    def with_gap(self, *a, **kw):
        real_init(self, *a, **kw)
        from prometheus_client import Gauge

        self.mystery = Gauge("steadyserve_mystery", "", registry=self.registry)

    monkeypatch.setattr(Metrics, "__init__", with_gap)
    with pytest.raises(Undocumented, match="steadyserve_mystery"):
        docgen.metrics_reference()


def test_every_alert_links_to_a_complete_runbook_section(tmp_path) -> None:
    page = docgen.alerts_reference()
    rules = docgen.alert_rules()
    assert len(rules) >= 9
    for rule in rules:
        assert f"`{rule['alert']}`" in page
        assert rule["annotations"]["runbook_url"] == f"runbooks/#{rule['alert'].lower()}"
    # Without one section, or with a section that lacks a part, the page is refused.
    text = (DOCS / "runbooks.md").read_text()
    gone = tmp_path / "no_section.md"
    gone.write_text(text.replace("## SteadyserveEngineDead", "## SomethingElse"))
    with pytest.raises(Undocumented, match="SteadyserveEngineDead: no '## SteadyserveEngineDead' section"):
        docgen.alerts_reference(gone)
    partial = tmp_path / "partial.md"
    start = text.index("## SteadyserveKVCacheFull")
    partial.write_text(text[:start] + text[start:].replace("**What to do.**", "**Then.**", 1))
    with pytest.raises(Undocumented, match="SteadyserveKVCacheFull: runbook lacks 'What to do'"):
        docgen.alerts_reference(partial)


def http_error_codes() -> set[str]:
    """Every `code` the server can put in an error body, read from the source (error responses and every
    Refused(reason, ...)), plus the engine's refusal and stream-ending reasons that reach clients as codes."""
    from steadyserve.api.events import END_STATUS
    from steadyserve.api.http.errors import REFUSAL_STATUS

    codes = set(REFUSAL_STATUS) | set(END_STATUS)
    # Refusals (steadyserve.limits.Refused) are raised by the shared request code too, not only by api/http.
    sources = [*(ROOT / "src/steadyserve/api").rglob("*.py"), ROOT / "src/steadyserve/limits.py"]
    for f in sources:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            pos = {"error_response": 4, "Refused": 0, "error_body": 3}.get(name or "")
            if pos is None:
                continue
            values = ([node.args[pos]] if len(node.args) > pos else []) + [k.value for k in node.keywords
                                                                           if k.arg == "code"]
            codes |= {c.value for v in values for c in ast.walk(v)
                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return codes


def test_errors_page_lists_every_code_the_server_sends() -> None:
    page = (DOCS / "reference" / "errors.md").read_text()
    codes = http_error_codes()
    assert {"invalid_json", "overloaded", "stall", "model_not_found"} <= codes  # the scan finds them
    assert not [c for c in codes if f"| `{c}` |" not in page], "codes missing from docs/reference/errors.md"


def test_errors_page_lists_the_ray_ingress_codes() -> None:
    """The codes the Ray Serve ingress puts in its own error bodies (`_error_json(message, type, code)`)."""
    page = (DOCS / "reference" / "errors.md").read_text()
    tree = ast.parse((ROOT / "src/steadyserve/ray/ingress.py").read_text())
    codes = {node.args[2].value for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "_error_json" and len(node.args) > 2
             and isinstance(node.args[2], ast.Constant)}
    codes |= {node.args[4].value for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "attr", None) == "_ws_fail" and len(node.args) > 4
              and isinstance(node.args[4], ast.Constant)}
    assert {"overloaded", "replica_lost", "request_too_large"} <= codes  # the scan finds them
    assert not [c for c in codes if f"| `{c}` |" not in page], "codes missing from docs/reference/errors.md"


# ---- the guides' snippets run ----------------------------------------------------------------------------------

def blocks(name: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((DOCS / name).read_text())]


def test_console_blocks_only_hold_commands_the_suite_cannot_run() -> None:
    for name in GUIDES:
        for lang, body in blocks(name):
            assert lang not in ("bash", "shell"), f"{name}: use ```sh (run by the tests) or ```console"
            if lang == "console":
                for line in body.splitlines():
                    if line.startswith("$ "):
                        assert line[2:].startswith(ALLOWED_UNRUN), f"{name}: {line!r} could run: make it ```sh"


@pytest.fixture(scope="module")
def docs_server(long_model: str):  # 4096 positions: the tool examples' prompts fit, as they do SmolLM2's
    from steadyserve.testing.server import ServerProcess

    with ServerProcess(long_model) as s:
        yield s


@pytest.mark.parametrize("name", GUIDES)
def test_guide_snippets_run_against_a_live_server(name: str, docs_server, tmp_path) -> None:
    runnable = [(lang, body) for lang, body in blocks(name) if lang in ("sh", "python")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for i, (lang, body) in enumerate(runnable):
        code = body.replace("localhost:8000", f"127.0.0.1:{docs_server.http_port}").replace(
            "localhost:50051", docs_server.grpc_addr)
        # curl -s exits 0 on an HTTP error; here an error status fails the block (the docs stay copy-pasteable).
        argv = ["bash", "-eo", "pipefail", "-c", 'curl() { command curl --fail-with-body "$@"; }\n' + code] \
            if lang == "sh" else [sys.executable, "-c", code]
        res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, (f"{name}, block {i + 1} ({lang}) exited {res.returncode}:\n{body}\n"
                                     f"stdout: {res.stdout[-2000:]}\nstderr: {res.stderr[-2000:]}")
        assert res.stdout.strip(), f"{name}, block {i + 1} printed nothing:\n{body}"
