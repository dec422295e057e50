"""Reading benchmarks/results/*.json for the results page: which benchmark, CPU kind, model, sampling, speculation.

Most JSON files do not say all of that in fields of their own, so each is derived here from what the file does
record, and a file where a needed fact is not recorded is skipped and reported, never placed by a guess:
- the benchmark: the file name's prefix (each script's default output name; later runs added suffixes), checked
  against the keys that benchmark writes;
- the CPU: the JSON's `cpu` (or `machine`) string. "AMD EPYC" is written for Zen 1, Zen 4 and Zen 5 machines
  alike, so the generation is taken only from the string itself ("Zen 4") or the file's `zen1` tag, and is
  otherwise shown as not recorded; a file with no CPU string is skipped;
- the model: the `gguf` field, or the command's --model, or the script's default model where the command names none;
- sampling: a `sampling` field where a JSON has one; otherwise the setting the benchmark's code sends, which has
  not changed since these files were written (greedy for the serving, long-prompt and speculation benchmarks;
  temperature 0.8 with a seed per request for tenants);
- speculation: steadyserve's rows run `--speculation auto` (n-gram drafts where they are exact, off elsewhere) by
  default since b18e5d3 (2026-12-02 04:28 UTC) unless the command says otherwise; peers draft nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # steadyserve's default model, what a command without --model ran
SPECULATION_DEFAULT_SINCE = "2026-12-02T04:28"  # b18e5d3 made `--speculation auto` steadyserve's default
GREEDY = "greedy (temperature 0)"
# File-name prefix -> the benchmark it is, and keys its JSON must have (what the page reads from it).
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "int8_serving_": ("int8_serving", ("levels", "servers", "date")),
    "gguf_serving_": ("gguf_serving", ("levels", "servers", "date")),
    "gguf_serving.json": ("gguf_serving", ("levels", "servers", "date")),
    "model_serving_": ("model_serving", ("levels", "servers", "date")),
    "long_prompt": ("long_prompt", ()),
    "speculation_epyc": ("speculation", ("c1", "date")),
    "speculation_xeon": ("speculation", ("c1", "date")),
    "speculation_int8": ("speculation", ("c1", "date")),
    "speculation.json": ("speculation", ("c1", "date")),
    "startup_": ("startup", ("runs", "machine")),
    "tenants": ("tenants", ("verdicts", "machine")),
}
SERVING = ("int8_serving", "gguf_serving", "model_serving")  # one table shape: servers x concurrency levels
SAMPLING = {**{k: GREEDY for k in SERVING}, "long_prompt": GREEDY, "speculation": GREEDY,
            "tenants": "temperature 0.8, a seed per request", "startup": "none (no tokens generated)"}


@dataclass
class Run:
    file: str  # the JSON's file name under benchmarks/results/ (with "#case" for one case of a long_prompt file)
    kind: str  # one of SERVING, long_prompt, speculation, startup, tenants
    cpu: str  # the CPU kind, as recorded (and its generation where the file records it)
    model: str  # the GGUF's name, with "random weights" where it is a shape-only file
    date: str  # ISO date-time of the run as the JSON records it ("" where it records none)
    sampling: str  # how tokens were chosen
    data: dict[str, Any]  # the JSON (or the case's part of it)
    variant: str = ""  # what else keeps two runs apart on the page: a long prompt's length
    notes: list[str] = field(default_factory=list)  # how a fact not in the JSON was derived


@dataclass
class Loaded:
    runs: list[Run]  # every run placed on the page's grouping
    skipped: list[tuple[str, str]]  # (file, why): files not placed because a fact the page needs is not recorded
    unrendered: list[str]  # files of benchmarks this page does not show (profiles, accuracy, ...), listed not read


def cpu_kind(recorded: str | None, file: str) -> str | None:
    """The CPU kind a run is grouped under, or None where the JSON names no CPU."""
    if not recorded or not recorded.strip():
        return None
    s = recorded.replace("(R)", "").replace("  ", " ").strip()
    if "EPYC" in s:
        m = re.search(r"Zen ?(\d)", s)
        if m:
            return f"AMD EPYC Zen {m.group(1)}"
        if re.search(r"(^|_)zen1(_|\.|$)", file):  # the file's own tag, written by the session that ran it there
            return "AMD EPYC Zen 1 (AVX2 only)"
        return "AMD EPYC (generation not recorded)"
    return s.split(",")[0].strip()


def model_label(gguf: str) -> str:
    """`smollm2-1.7b-shape-Q4_K_M.gguf` -> its stem, marked as random weights (make_random_gguf.py's shape files)."""
    stem = gguf[:-5] if gguf.endswith(".gguf") else gguf
    return f"{stem} (random weights)" if "-shape" in stem or "random" in stem else stem


def model_of(d: dict[str, Any], notes: list[str]) -> str | None:
    if d.get("gguf"):
        return model_label(str(d["gguf"]))
    cmd = str(d.get("command", ""))
    m = re.search(r"--model[ =](\S+)", cmd)
    if m:
        return model_label(Path(m.group(1)).name)
    if "command" in d:
        notes.append(f"model: the command names no --model, so the default model ({DEFAULT_MODEL})")
        return model_label(DEFAULT_MODEL)
    return None


def speculation_of(server: str, settings: dict[str, Any] | str, date: str) -> str:
    """What drafted tokens for one server row: 'off', 'auto (n-gram)' or an explicit flag's value."""
    if not server.startswith("steadyserve") and server not in ("default", "speculation-off", "int8", "portable"):
        return "none (peer)"
    cmd = settings if isinstance(settings, str) else str(settings.get("command", ""))
    m = re.search(r"--speculation[ =](\S+)", cmd)
    if m:
        return m.group(1)
    if not date:
        return "not recorded"
    # auto drafts n-grams only where that is exact (batch-invariant numerics, multi-row kernels), else is off
    return "auto (default)" if date >= SPECULATION_DEFAULT_SINCE else "off (before auto was the default)"


def kind_of(name: str) -> tuple[str, tuple[str, ...]] | None:
    for prefix, kind in KINDS.items():
        if name == prefix or name.startswith(prefix):
            return kind
    return None


def _one(name: str, kind: str, d: dict[str, Any], cpu_field: Any, skipped: list[tuple[str, str]]) -> Run | None:
    cpu = cpu_kind(cpu_field if isinstance(cpu_field, str) else None, name)
    if cpu is None:
        skipped.append((name, "no CPU name in the JSON"))
        return None
    notes: list[str] = []
    model = model_of(d, notes) if kind not in ("tenants", "startup") else model_label(d.get("settings", {}).get("model") or DEFAULT_MODEL)
    if kind == "startup":
        files = sorted({Path(r.get("file", "")).name for r in d.get("runs", {}).values() if isinstance(r, dict)})
        model = model_label(files[0]) if len(files) == 1 else None
    if model is None:
        skipped.append((name, "no model recorded (no gguf, no command)"))
        return None
    sampling = str(d["sampling"]) if "sampling" in d else SAMPLING[kind]
    if "sampling" not in d:
        notes.append(f"sampling not in the JSON: {sampling}, what {kind} benchmarks send")
    variant = str(d.get("prompt_tokens", "")) if kind == "long_prompt" else ""
    if kind in SERVING and not d.get("levels"):  # a long prompt's TTFT alone (--levels ''): its own pick, no table
        m = re.search(r"--long-prompt[ =](\d+)", str(d.get("command", "")))
        variant = f"long prompt {m.group(1) if m else '?'}"
    return Run(name, kind, cpu, model, str(d.get("date", "")), sampling, d, notes=notes, variant=variant)


def load(results: Path) -> Loaded:
    """Every *.json under results/, sorted by name (the page must not depend on the directory's order)."""
    runs: list[Run] = []
    skipped: list[tuple[str, str]] = []
    unrendered: list[str] = []
    for path in sorted(results.glob("*.json")):
        name = path.name
        k = kind_of(name)
        if k is None:
            unrendered.append(name)
            continue
        kind, needs = k
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            skipped.append((name, f"not readable JSON: {e}"))
            continue
        if kind == "long_prompt":  # one file holds several cases, each with its own CPU, model and date
            for case, sub in sorted(d.items()):
                if not isinstance(sub, dict) or "ttft" not in sub:
                    skipped.append((f"{name}#{case}", "not a long-prompt case (no ttft)"))
                    continue
                run = _one(f"{name}#{case}", kind, sub, sub.get("cpu"), skipped)
                if run:
                    runs.append(run)
            continue
        missing = [key for key in needs if key not in d]
        if missing:
            skipped.append((name, f"not a {kind} result: no {', '.join(missing)}"))
            continue
        machine = d.get("machine")
        cpu_field = d.get("cpu") or (machine.get("cpu") if isinstance(machine, dict) else machine)
        run = _one(name, kind, d, cpu_field, skipped)
        if run:
            runs.append(run)
    return Loaded(runs, skipped, unrendered)


def latest(runs: list[Run]) -> dict[tuple[str, str, str, str], Run]:
    """(kind, cpu, model, variant) -> its latest run; a tie on the date goes to the later file name (a stable pick)."""
    out: dict[tuple[str, str, str, str], Run] = {}
    for r in sorted(runs, key=lambda r: (r.date, r.file)):
        out[(r.kind, r.cpu, r.model, r.variant)] = r
    return out
