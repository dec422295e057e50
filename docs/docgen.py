"""Reference pages of the documentation site, generated from the code so they cannot drift.

A build script, not part of the installed package: it reads repository paths (proto/, deploy/, config.py)
and imports the command line, which sits above everything else in the layering.

Each function returns one Markdown page and raises `Undocumented` naming every
item that lacks its documentation, so `make docs` (and the test suite, which
builds the site in strict mode) fails when a flag, endpoint, request field,
rpc, message field, metric or alert is added without it:

* `cli_reference`: every `steadyserve serve` flag, from the argparse parser and
  the config tree it is generated from (config.py: each field's Flag metadata names
  its flag, default and choices, its comment says what it means; each `ConfigError`
  in a `validate()` is a constraint).
* `http_reference`: every route, from the app's own OpenAPI schema and routes;
  request fields with their types, limits and descriptions, extensions marked.
* `grpc_reference`: every rpc, message and field, from the proto's comments
  (protoc's source info).
* `metrics_reference`: every metric in the metrics registry.
* `alerts_reference`: every rule in deploy/prometheus/alerts.yml, each with a
  `runbook_url` annotation that points at its section in runbooks.md.
"""

from __future__ import annotations

import ast
import json
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository: proto/, deploy/, docs/, src/
CONFIG_PY = ROOT / "src" / "steadyserve" / "config.py"
RUNBOOK_PARTS = ("What it means", "How to confirm", "What to do")


class Undocumented(Exception):
    """Items that lack documentation; the message lists them all."""

    def __init__(self, page: str, items: list[str]) -> None:
        super().__init__(f"{page}: undocumented: " + "; ".join(items))
        self.items = items


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---- serve flags ------------------------------------------------------------------------------------------------

def _field_comments() -> dict[tuple[str, str], str]:
    """(section, field) -> the comment on the field's line in config.py (its meaning)."""
    out: dict[tuple[str, str], str] = {}
    section = ""
    for line in CONFIG_PY.read_text().splitlines():
        m = re.match(r"class (\w+)Config\b", line)
        if m:
            section = m.group(1).lower()
        m = re.match(r"\s+(\w+): [^=]+= .*?  # (.*)$", line)
        if m and section:
            out[(section, m.group(1))] = m.group(2)
    return out


def config_flags() -> dict[str, tuple[str, str, Any, Any]]:
    """flag -> (config field as section.field, meaning, default as shown, config.Flag or None), from the config
    tree: a field's Flag metadata names its flag (the comment says what it means); a field without one may still
    name its flag at the head of its comment (`--flag: meaning`), the older form."""
    from dataclasses import MISSING, fields

    from steadyserve.config import Config, flag_of

    comments = _field_comments()
    out: dict[str, tuple[str, str, Any, Any]] = {}
    for sf in fields(Config):
        section = type(getattr(Config(), sf.name))
        for f in fields(section):
            text = comments.get((sf.name, f.name), "")
            spec = flag_of(f)
            head, sep, rest = text.partition(":")
            named = re.findall(r"--[a-z0-9-]+", head) if sep else []
            meaning = rest.strip() if named else text
            default = f.default if f.default is not MISSING else ""
            if spec is not None:  # a store-true flag that turns its field off is itself off by default
                default = (not default) if spec.sets_false else spec.shown(default)
            for flag in [spec.name] if spec is not None else named:
                out[flag] = (f"{sf.name}.{f.name}", meaning, default, spec)
    return out


def config_comments() -> dict[str, tuple[str, str]]:
    """flag -> (config field as section.field, meaning)."""
    return {flag: (path, meaning) for flag, (path, meaning, _, _) in config_flags().items()}


def config_constraints() -> dict[str, list[str]]:
    """flag -> the messages of the ConfigErrors that validation raises for it (what it enforces)."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(CONFIG_PY.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ConfigError" and node.args:
            arg = node.args[0]
            parts = [v.value for v in arg.values if isinstance(v, ast.Constant)] if isinstance(arg, ast.JoinedStr) \
                else [arg.value] if isinstance(arg, ast.Constant) else []
            text = re.sub(r",? not $|: cannot parse size $", "", "…".join(parts)).strip()
            for flag in set(re.findall(r"--[a-z0-9-]+", text)):
                out.setdefault(flag, []).append(text)
    return out


def cli_reference() -> str:
    from steadyserve.cli import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags, constraints = config_flags(), config_constraints()
    missing: list[str] = []
    lines = ["# `steadyserve serve` flags", "",
             "Generated from the command's parser and the config tree it maps onto (`src/steadyserve/config.py`): "
             "every flag sets exactly one field. *Enforced* lists what start-up validation refuses, in the words "
             "of its error message. `steadyserve info` takes the same flags.", ""]
    for group in serve._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | default | config field | meaning | enforced |", "|---|---|---|---|---|"]
        for a in actions:
            flag = max(a.option_strings, key=len)
            names = " / ".join(f"`{o}`" for o in a.option_strings)
            field, meaning, shown, spec = flags.get(flag.replace("--no-", "--"), ("", "", a.default, None))
            helptext = (a.help or "").replace("%%", "%").replace("%(default)s", str(shown))
            if not helptext:
                missing.append(f"{flag}: no help text")
            if not field:
                missing.append(f"{flag}: no config field comment names it")
            default = "" if shown in (None, "") else f"`{shown}`"
            if flag == "--api-key":
                default = "`$STEADYSERVE_API_KEY`"
            enforced = list(constraints.get(flag, []))
            choices = spec.choices if spec is not None else a.choices
            if choices:
                enforced.append("one of " + ", ".join(f"`{c}`" for c in choices))
            # The config comment says what the field means; --help's text is the fallback (minus its default).
            text = meaning or re.sub(r"\s*\(default: [^)]*\)", "", helptext)
            lines.append(f"| {names} | {default} | `{field}` | {_cell(text)} | {_cell('; '.join(enforced))} |")
        lines.append("")
    if missing:
        raise Undocumented("reference/cli.md", missing)
    return "\n".join(lines)


# ---- HTTP ------------------------------------------------------------------------------------------------------

def build_http_app() -> Any:
    """The HTTP app, built without a model: enough to read its routes and OpenAPI schema."""
    from steadyserve.api.console import mount_console
    from steadyserve.api.http.app import create_app
    from steadyserve.config import Config

    state = SimpleNamespace(config=Config(), metrics=None)
    app = create_app(state)  # type: ignore[arg-type]
    mount_console(app, state)  # its JSON endpoints are part of the HTTP API too
    return app


def _type_of(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " or ".join(_type_of(p) for p in prop["anyOf"])
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if prop.get("type") == "array":
        return f"array of {_type_of(prop.get('items', {}))}"
    if "const" in prop:
        return f"`{prop['const']!r}`"
    if "enum" in prop:
        return " \\| ".join(f"`{e}`" for e in prop["enum"])
    return str(prop.get("type", "any"))


def _limits(prop: dict[str, Any]) -> str:
    parts = [f"{sym} {prop[k]}" for k, sym in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
                                              ("exclusiveMaximum", "<"), ("minItems", "items ≥"),
                                              ("maxItems", "items ≤")) if k in prop]
    for alt in prop.get("anyOf", []):
        sub = _limits(alt)
        if sub:
            parts.append(sub)
    return ", ".join(parts)


def http_reference() -> str:
    from starlette.routing import WebSocketRoute

    app = build_http_app()
    spec = app.openapi()
    schemas = spec.get("components", {}).get("schemas", {})
    missing: list[str] = []
    lines = ["# HTTP API", "",
             "Generated from the server's own OpenAPI schema (`GET /openapi.json` on a running server) and its routes. "
             "Fields marked **extension** are steadyserve's, not OpenAI's. Every response carries the headers "
             "`x-request-id` and `x-steadyserve-fingerprint`; errors have OpenAI's shape "
             "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}` (see [Errors](errors.md)).", ""]
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            desc = (op.get("description") or "").strip()
            if not desc:
                missing.append(f"{method.upper()} {path}: no docstring on its handler")
            lines += [f"## `{method.upper()} {path}`", "", desc, ""]
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            if ref:
                lines += _schema_table(ref.rsplit("/", 1)[-1], schemas, missing)
    for route in app.routes:
        if isinstance(route, WebSocketRoute):
            desc = (route.endpoint.__doc__ or "").strip()
            if not desc:
                missing.append(f"WebSocket {route.path}: no docstring on its handler")
            lines += [f"## `WebSocket {route.path}`", "", _dedent(desc), ""]
    if missing:
        raise Undocumented("reference/http.md", missing)
    return "\n".join(lines)


def _dedent(text: str) -> str:
    import textwrap

    first, _, rest = text.partition("\n")
    return first + "\n" + textwrap.dedent(rest) if rest else first


def _schema_table(name: str, schemas: dict[str, Any], missing: list[str], seen: set[str] | None = None) -> list[str]:
    seen = seen if seen is not None else set()
    if name in seen:
        return []
    seen.add(name)
    schema = schemas[name]
    required = set(schema.get("required", []))
    lines = [f"**{name}**" + (f": {schema['description'].strip()}" if schema.get("description") else ""), "",
             "| field | type | default | limits | meaning |", "|---|---|---|---|---|"]
    nested = []
    for fname, prop in schema.get("properties", {}).items():
        desc = prop.get("description", "")
        if not desc:
            missing.append(f"{name}.{fname}: no description")
        if prop.get("x-extension"):
            desc = f"**extension**. {desc}"
        default = "required" if fname in required else f"`{json.dumps(prop['default'])}`" if "default" in prop else ""
        lines.append(f"| `{fname}` | {_cell(_type_of(prop))} | {_cell(default)} | {_cell(_limits(prop))} | {_cell(desc)} |")
        for ref in re.findall(r"#/components/schemas/(\w+)", str(prop)):
            nested.append(ref)
    lines.append("")
    for ref in nested:
        if ref in schemas:
            lines += _schema_table(ref, schemas, missing, seen)
    return lines


# ---- gRPC -------------------------------------------------------------------------------------------------------

def grpc_reference(proto: Path = ROOT / "proto" / "steadyserve" / "v1" / "inference.proto") -> str:
    """From protoc's source info: the leading comment of every service, rpc, message, enum and field."""
    import grpc_tools
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        rc = protoc.main(["protoc", f"-I{proto.parents[2]}", f"-I{include}", "--include_source_info",
                          f"--descriptor_set_out={out}", str(proto.relative_to(proto.parents[2]))])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    f = fds.file[0]
    comments = {tuple(loc.path): loc.leading_comments.strip() for loc in f.source_code_info.location}
    missing: list[str] = []
    header = comments.get((12,), "") or comments.get((2,), "")  # the syntax/package statement's comment
    lines = ["# gRPC API", "", f"Generated from the comments of `{proto.relative_to(ROOT)}`, package `{f.package}`.", ""]
    if header:
        lines += ["```text", header, "```", ""]

    def doc(path: tuple[int, ...], what: str) -> str:
        text = comments.get(path, "")
        if not text:
            missing.append(what)
        return text

    for si, svc in enumerate(f.service):
        lines += [f"## service `{f.package}.{svc.name}`", "", doc((6, si), f"service {svc.name}"), ""]
        for mi, m in enumerate(svc.method):
            stream = "stream " if m.server_streaming else ""
            lines += [f"### `rpc {m.name}({m.input_type.rsplit('.', 1)[-1]}) returns ({stream}"
                      f"{m.output_type.rsplit('.', 1)[-1]})`", "", doc((6, si, 2, mi), f"rpc {m.name}"), ""]

    def message(path: tuple[int, ...], msg: Any, prefix: str) -> None:
        name = prefix + msg.name
        lines.extend([f"### message `{name}`", "", doc(path, f"message {name}"), "",
                      "| field | number | type | meaning |", "|---|---|---|---|"])
        for fi, fld in enumerate(msg.field):
            typ = fld.type_name.rsplit(".", 1)[-1] if fld.type_name else \
                descriptor_pb2.FieldDescriptorProto.Type.Name(fld.type)[5:].lower()
            if fld.label == fld.LABEL_REPEATED:
                typ = f"repeated {typ}"
            lines.append(f"| `{fld.name}` | {fld.number} | {typ} | {_cell(doc(path + (2, fi), f'{name}.{fld.name}'))} |")
        lines.append("")
        for ni, nested in enumerate(msg.nested_type):
            if not nested.options.map_entry:
                message(path + (3, ni), nested, name + ".")
        for ei, enum in enumerate(msg.enum_type):
            enum_section(path + (4, ei), enum, name + ".")

    def enum_section(path: tuple[int, ...], enum: Any, prefix: str) -> None:
        name = prefix + enum.name
        lines.extend([f"### enum `{name}`", "", doc(path, f"enum {name}"), "", "| value | number | meaning |",
                      "|---|---|---|"])
        for vi, v in enumerate(enum.value):
            lines.append(f"| `{v.name}` | {v.number} | {_cell(comments.get(path + (2, vi), ''))} |")
        lines.append("")

    lines += ["## Messages", ""]
    for i, msg in enumerate(f.message_type):
        message((4, i), msg, "")
    for i, enum in enumerate(f.enum_type):
        enum_section((5, i), enum, "")
    if missing:
        raise Undocumented("reference/grpc.md", missing)
    return "\n".join(lines)


# ---- metrics and alerts ---------------------------------------------------------------------------------------------

def metrics_reference() -> str:
    from prometheus_client.metrics import MetricWrapperBase

    from steadyserve.metrics import Metrics

    m = Metrics("model", "fingerprint", "cpu", "float32", True)
    missing: list[str] = []
    rows = []
    for obj in vars(m).values():
        if isinstance(obj, MetricWrapperBase):
            name = obj._name + ("_total" if obj._type == "counter" else "")
            rows.append((name, obj._type, ", ".join(f"`{x}`" for x in obj._labelnames), obj._documentation))
    for family in m.registry.collect():  # collectors outside the wrappers (process RSS and CPU)
        if not any(r[0].startswith(family.name) for r in rows):
            rows.append((family.name, family.type, "", family.documentation))
    lines = ["# Metrics", "", "Generated from the metrics registry (`src/steadyserve/metrics.py`), served at "
             "`GET /metrics` in Prometheus' text format. Histograms export `_bucket`, `_sum` and `_count` series; counters and histograms also a `_created` "
             "timestamp (prometheus-client's convention).", "",
             "| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, typ, labels, doc in sorted(rows):
        if not doc.strip():
            missing.append(name)
        lines.append(f"| `{name}` | {typ} | {labels} | {_cell(doc)} |")
    if missing:
        raise Undocumented("reference/metrics.md", missing)
    return "\n".join(lines) + "\n"


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def alert_rules(path: Path = ROOT / "deploy" / "prometheus" / "alerts.yml") -> list[dict[str, Any]]:
    import yaml

    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "alert" in r]


def alerts_reference(runbooks: Path = ROOT / "docs" / "runbooks.md") -> str:
    text = runbooks.read_text()
    sections = {m.group(1): m.start() for m in re.finditer(r"^## (\w+)\s*$", text, re.M)}
    missing: list[str] = []
    lines = ["# Alerts", "", "Generated from `deploy/prometheus/alerts.yml`. Each alert's `runbook_url` annotation "
             "points at its section of the [runbooks](../runbooks.md), relative to where this site is hosted.", "",
             "| alert | severity | for | summary | runbook |", "|---|---|---|---|---|"]
    for rule in alert_rules():
        name = rule["alert"]
        url = rule.get("annotations", {}).get("runbook_url", "")
        if not url.endswith(f"runbooks/#{slug(name)}"):
            missing.append(f"{name}: runbook_url must end in runbooks/#{slug(name)}")
        if name not in sections:
            missing.append(f"{name}: no '## {name}' section in docs/runbooks.md")
        else:
            body = text[sections[name]:]
            nxt = re.search(r"^## ", body[3:], re.M)
            body = body[:nxt.start() + 3] if nxt else body
            missing += [f"{name}: runbook lacks '{p}'" for p in RUNBOOK_PARTS if p not in body]
        lines.append(f"| `{name}` | {rule.get('labels', {}).get('severity', '')} | {rule.get('for', '')} | "
                     f"{_cell(rule.get('annotations', {}).get('summary', ''))} | [runbook](../runbooks.md#{slug(name)}) |")
    lines += ["", "## Rules", ""]
    for rule in alert_rules():
        lines += [f"### {rule['alert']}", "", "```promql", rule["expr"].strip(), "```", ""]
    if missing:
        raise Undocumented("reference/alerts.md", missing)
    return "\n".join(lines)


PAGES = {"reference/cli.md": cli_reference, "reference/http.md": http_reference,
         "reference/grpc.md": grpc_reference, "reference/metrics.md": metrics_reference,
         "reference/alerts.md": alerts_reference}
