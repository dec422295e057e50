"""The results page: docs/benchmarks-results.md and its figures (docs/img/bench/*.svg), from benchmarks/results/*.json.

One section per CPU kind and model, holding the latest run of each benchmark (report_runs.py says how a file's CPU,
model, sampling and speculation are found, and which files it skips). The same JSON gives byte-identical output:
everything is sorted, numbers are formatted with fixed precision, and nothing reads the clock. `make bench-report`.

    .venv/bin/python benchmarks/report.py [--results DIR] [--docs DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from report_runs import SERVING, Loaded, Run, latest, load, speculation_of
from report_svg import Series, bar_chart, line_chart

HERE = Path(__file__).resolve().parent
PAGE = "benchmarks-results.md"
IMG = "img/bench"
TITLES = {"int8_serving": "Served throughput against peers (benchmarks/int8_serving.py)",
          "gguf_serving": "GGUF serving against llama.cpp and transformers (benchmarks/gguf_serving.py)",
          "model_serving": "A packaged model against llama-server (benchmarks/model_serving.py)"}


def num(v: Any, digits: int = 1) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else "-"


def slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def caption(r: Run, speculation: str) -> str:
    """What every table and figure names: the CPU, the model, the sampling, speculation, and where it came from."""
    when = r.date or "date not recorded"
    return (f"CPU: **{r.cpu}** · model: **{r.model}** · sampling: {r.sampling} · speculation: {speculation} · "
            f"`{r.file}` ({when})")


def figure_title(what: str, r: Run, speculation: str) -> list[str]:
    return [what, f"{r.cpu} · {r.model}", f"{r.sampling} · speculation: {speculation} · {r.date or 'undated'}"]


def serving(r: Run, figs: dict[str, str]) -> list[str]:
    """One row per server: tok/s and TTFT p50 at each concurrency, the long prompt's TTFT and peak RSS."""
    d = r.data
    levels = sorted(d["levels"], key=int)
    servers = sorted({s for lv in d["levels"].values() for s in lv})
    spec = {s: speculation_of(s, d["servers"].get(s, {}), r.date) for s in servers}
    ours = sorted({v for k, v in spec.items() if v != "none (peer)"})
    spec_text = f"steadyserve {', '.join(ours) or '-'}; peers none"
    long_prompt = re.search(r"--long-prompt[ =](\d+)", str(d.get("command", "")))
    lp = f"TTFT {long_prompt.group(1) if long_prompt else 1000}-token prompt (s)"
    head = (["server", "speculation"] + [f"c={c} tok/s" for c in levels] + [f"c={c} TTFT p50 (s)" for c in levels]
            + ([lp] if d.get("ttft_long_prompt_s") else []) + ["peak RSS (MiB)"])
    out = [f"### {TITLES[r.kind]}", "", caption(r, spec_text)
           + f"; {d.get('output_tokens', '?')} output tokens per stream, {d.get('threads', '?')} threads per server.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in servers:
        row = [s, spec[s]]
        row += [num(d["levels"][c].get(s, {}).get("output_tokens_per_s")) for c in levels]
        row += [num(d["levels"][c].get(s, {}).get("ttft_s", {}).get("p50"), 2) for c in levels]
        if d.get("ttft_long_prompt_s"):
            row.append(num(d["ttft_long_prompt_s"].get(s), 2))
        row.append(num(d.get("peak_rss_mib", {}).get(s), 0))
        out.append("| " + " | ".join(row) + " |")
    direct = [s for s in servers if d["servers"].get(s, {}).get("transport")]
    if direct:  # measured through an engine's own API, not over HTTP (openvino_peer.py)
        out += ["", "Measured through its engine's API in-process, not over HTTP, which favours it: "
                + ", ".join(f"`{s}` ({d['servers'][s]['transport']})" for s in direct) + "."]
    if d.get("ratios"):
        out += ["", "Ratios, as the run computed them:", ""]
        out += [f"- {k}: {num(v, 2)}" for k, v in sorted(d["ratios"].items())]
    if len(levels) > 1:
        name = slug(r.kind, r.cpu, r.model, "throughput") + ".svg"
        series = [Series(s, [(float(c), d["levels"][c][s]["output_tokens_per_s"]) for c in levels
                             if s in d["levels"][c]]) for s in servers]
        figs[name] = line_chart(figure_title("Output tok/s against concurrency", r, spec_text), "concurrent streams",
                                "output tokens/s", series, log_x=True)
        out += ["", f"![Output tok/s against concurrency, {r.cpu}, {r.model}]({IMG}/{name})"]
    bound = d.get("bandwidth_bound_c1_tok_s")
    if bound and levels[0] == "1":
        name = slug(r.kind, r.cpu, r.model, "c1-bound") + ".svg"
        bars = [(f"{s} ({spec[s]})", d["levels"]["1"][s]["output_tokens_per_s"]) for s in servers
                if s in d["levels"]["1"]]
        figs[name] = bar_chart(figure_title("c=1 tok/s against the read-bandwidth bound", r, spec_text),
                               "output tokens/s at c=1", bars, [("bandwidth bound", bound)])
        out += ["", f"c=1 against the bound (every weight byte read once per token; {num(d.get('read_bandwidth_gb_s'))} "
                    f"GB/s read, {d.get('gguf_bytes', 0) / 1e9:.2f} GB of weights): {num(bound)} tok/s.", "",
                f"![c=1 tok/s against the read-bandwidth bound, {r.cpu}, {r.model}]({IMG}/{name})"]
    return out + [""]


def from_serving(r: Run) -> Run | None:
    """int8_serving's long-prompt TTFT as a long_prompt run (its `default` row is steadyserve on default flags)."""
    ttft = r.data.get("ttft_long_prompt_s")
    if not ttft:
        return None
    m = re.search(r"--long-prompt[ =](\d+)", str(r.data.get("command", "")))
    data = {"ttft": {("steadyserve" if s == "default" else s): {"ttft_s": v} for s, v in ttft.items()
                     if s in ("default", "llama-server", "vllm") or s.startswith("openvino")},
            "servers": r.data.get("servers", {}).get("default", {})}
    return Run(r.file, "long_prompt", r.cpu, r.model, r.date, r.sampling, data, variant=m.group(1) if m else "1000")


def long_prompts(runs: list[Run], figs: dict[str, str]) -> list[str]:
    """The TTFT of one long prompt, one row per prompt length (each length's latest run), and a figure."""
    runs = sorted(runs, key=lambda r: (int(r.variant or 0), r.file))
    first = runs[0]
    servers = sorted({s for r in runs for s in r.data["ttft"]})
    out = ["### Time to first token of one long prompt (benchmarks/long_prompt.py)", "",
           caption(first, "steadyserve default flags of each run's date; llama-server none").split(" · `")[0] + ".", "",
           "| prompt tokens | " + " | ".join(f"{s} TTFT (s)" for s in servers) + " | run |",
           "|---|" + "---|" * len(servers) + "---|"]
    for r in runs:
        cells = [num(r.data["ttft"].get(s, {}).get("ttft_s"), 2) for s in servers]
        spec = speculation_of("steadyserve", r.data.get("servers", {}).get("steadyserve", ""), r.date)
        out.append(f"| {r.variant} | " + " | ".join(cells) + f" | `{r.file}` ({r.date}; steadyserve speculation {spec}) |")
    if len(runs) > 1:
        name = slug("long-prompt", first.cpu, first.model, "ttft") + ".svg"
        series = [Series(s, [(float(r.variant), r.data["ttft"][s]["ttft_s"]) for r in runs if s in r.data["ttft"]])
                  for s in servers]
        figs[name] = line_chart(figure_title("TTFT against prompt length", first, "as in the table"), "prompt tokens",
                                "seconds to the first token", series)
        out += ["", f"![TTFT against prompt length, {first.cpu}, {first.model}]({IMG}/{name})"]
    return out + [""]


def speculation(r: Run) -> list[str]:
    """c=1 with speculation off beside n-gram drafts (the default), per kind of request, and c=64."""
    d = r.data
    out = ["### c=1 with speculation off beside the default (benchmarks/speculation.py, engine, no HTTP)", "",
           caption(r, "off and ngram, the same requests through each") + f"; numerics {d.get('numerics', 'not recorded')}.",
           "", "| requests | off tok/s | ngram tok/s | ngram / off |", "|---|---|---|---|"]
    for group in sorted(d["c1"]):
        for task, t in sorted(d["c1"][group].items()):
            off, ng = t.get("off_tok_s"), t.get("ngram_tok_s")
            ratio = ng / off if isinstance(off, (int, float)) and isinstance(ng, (int, float)) and off else None
            out.append(f"| c=1 {group}: {task} | {num(off)} | {num(ng)} | {num(ratio, 2)} |")
    c64 = d.get("c64", {})
    if c64:
        ratio = c64["ngram_tok_s"] / c64["off_tok_s"] if c64.get("off_tok_s") else None
        out.append(f"| c=64 (all kinds at once) | {num(c64.get('off_tok_s'))} | {num(c64.get('ngram_tok_s'))} | "
                   f"{num(ratio, 2)} |")
    return out + ["", f"Every request's tokens identical between the two: {d.get('identical')}.", ""]


def startup(r: Run) -> list[str]:
    d = r.data
    out = ["### Start-up: seconds to ready and peak RSS (benchmarks/startup_profile.py)", "",
           caption(r, "not applicable") + f"; command `{d.get('command', '')}`.", "",
           "| run | ready (s) | peak RSS (MiB) | RSS at ready (MiB) | target (MiB) |", "|---|---|---|---|---|"]
    for name, x in sorted(d["runs"].items()):
        out.append(f"| {name} | {num(x.get('ready_s'), 2)} | {num(x.get('peak_rss_mib'), 0)} | "
                   f"{num(x.get('rss_at_ready_mib'), 0)} | {num(x.get('target_mib'), 0)} |")
    return out + [""]


def tenants(r: Run) -> list[str]:
    d = r.data
    out = ["### Tenants: a flood against a light tenant (benchmarks/tenants.py)", "",
           caption(r, speculation_of("steadyserve", "", r.date)) + ".", "", "| verdict | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in sorted(d["verdicts"].items())]
    return out + [""]


def render(loaded: Loaded) -> tuple[str, dict[str, str]]:
    """The page's Markdown and its figures (file name -> SVG text)."""
    figs: dict[str, str] = {}
    pick = latest(loaded.runs)
    groups = sorted({(cpu, model) for (_, cpu, model, _) in pick})
    out = ["# Benchmark results", "",
           "Generated by `make bench-report` (benchmarks/report.py) from the JSON under `benchmarks/results/`; "
           "do not edit by hand. For each CPU kind and model, the latest run of each benchmark. Every run's "
           "dated log is in `benchmarks/HISTORY.md`, and [Benchmarks](benchmarks.md) says how to run them.", "",
           "These are single runs on 2-core machines shared with other work: read the ratios within one run, "
           "not absolutes across runs. A JSON that does not record its CPU's generation (\"AMD EPYC\" is written "
           "for Zen 1, Zen 4 and Zen 5 alike) is shown under \"generation not recorded\". Sampling and "
           "speculation are derived where a JSON does not record them (benchmarks/report_runs.py says how).", ""]
    for cpu, model in groups:
        out += [f"## {cpu} · {model}", ""]
        for kind in SERVING:
            for key in sorted(k for k in pick if k[:3] == (kind, cpu, model) and pick[k].data.get("levels")):
                out += serving(pick[key], figs)
        lp = [pick[k] for k in sorted(pick) if k[:3] == ("long_prompt", cpu, model)]
        lp += [x for x in (from_serving(pick[k]) for k in sorted(pick) if k[:3] == ("int8_serving", cpu, model)) if x]
        if lp:
            out += long_prompts(lp, figs)
        for kind, fn in (("speculation", speculation), ("startup", startup), ("tenants", tenants)):
            if (kind, cpu, model, "") in pick:
                out += fn(pick[(kind, cpu, model, "")])
    out += ["## Files not on this page", ""]
    out += [f"- `{f}`: skipped, {why}" for f, why in loaded.skipped]
    out += [f"- `{f}`: a benchmark this page does not show (see `benchmarks/HISTORY.md`)" for f in loaded.unrendered]
    return "\n".join(out).rstrip() + "\n", figs


def write(results: Path, docs: Path) -> Loaded:
    """Write the page and its figures under docs/, replacing any figure no longer generated."""
    loaded = load(results)
    page, figs = render(loaded)
    img = docs / IMG
    img.mkdir(parents=True, exist_ok=True)
    for old in img.glob("*.svg"):
        if old.name not in figs:
            old.unlink()
    for name, svg in sorted(figs.items()):
        (img / name).write_text(svg)
    (docs / PAGE).write_text(page)
    return loaded


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--docs", type=Path, default=HERE.parent / "docs")
    a = p.parse_args()
    loaded = write(a.results, a.docs)
    print(f"{a.docs / PAGE}: {len(loaded.runs)} runs read, {len(loaded.skipped)} files skipped")
    for f, why in loaded.skipped:
        print(f"  skipped {f}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
