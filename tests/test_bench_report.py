"""The generated results page (benchmarks/report.py): up to date with the JSON, and honest about what each run was.

* The committed docs/benchmarks-results.md and docs/img/bench/*.svg equal what the generator writes from
  benchmarks/results/*.json today: a new result without a regenerated page fails here, naming the command.
* On a small synthetic set of results: a table names the CPU, the model, the sampling and speculation; a file
  without a CPU is listed as skipped, never placed; the same JSON gives byte-identical output.
No torch, no servers: the generator reads JSON and writes text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the generator is a script there, outside the installed package
import report  # noqa: E402

REGENERATE = "run `make bench-report` (or .venv/bin/python benchmarks/report.py) and commit docs/"


def generated(results: Path, docs: Path) -> dict[str, str]:
    report.write(results, docs)
    return {str(p.relative_to(docs)): p.read_text() for p in sorted(docs.rglob("*")) if p.is_file()}


def committed() -> dict[str, str]:
    docs = ROOT / "docs"
    files = [docs / report.PAGE, *sorted((docs / report.IMG).glob("*.svg"))]
    return {str(p.relative_to(docs)): p.read_text() for p in files if p.is_file()}


def test_committed_page_and_figures_match_the_json(tmp_path) -> None:
    fresh = generated(ROOT / "benchmarks" / "results", tmp_path)
    have = committed()
    assert sorted(fresh) == sorted(have), f"figures added or gone: {REGENERATE}"
    stale = [name for name in fresh if fresh[name] != have[name]]
    assert not stale, f"out of date with benchmarks/results/*.json: {stale}; {REGENERATE}"


def serving_run(cpu: str | None, date: str) -> dict:
    level = {"output_tokens_per_s": 100.0, "ttft_s": {"p50": 0.5}}
    d = {"date": date, "gguf": "tiny-shape-Q4_K_M.gguf", "gguf_bytes": 10**9, "threads": 2, "output_tokens": 32,
         "command": "benchmarks/int8_serving.py", "servers": {"default": {"command": "steadyserve serve"},
                                                              "llama-server": {"command": "llama-server"}},
         "levels": {"1": {"default": level, "llama-server": level}, "16": {"default": level, "llama-server": level}},
         "peak_rss_mib": {"default": 1000.0}, "bandwidth_bound_c1_tok_s": 150.0, "read_bandwidth_gb_s": 150.0}
    if cpu is not None:
        d["cpu"] = cpu
    return d


def test_synthetic_results_name_cpu_model_sampling_speculation_and_report_a_file_without_a_cpu(tmp_path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "int8_serving_tiny_xeon.json").write_text(json.dumps(serving_run("Intel(R) Xeon(R) Processor",
                                                                                  "2026-12-05T10:00+00:00")))
    (results / "int8_serving_tiny_epyc_zen1_a.json").write_text(json.dumps(serving_run("AMD EPYC",
                                                                                        "2026-12-05T11:00+00:00")))
    (results / "int8_serving_tiny_nocpu.json").write_text(json.dumps(serving_run(None, "2026-12-06T10:00+00:00")))
    older = serving_run("Intel(R) Xeon(R) Processor", "2026-12-01T10:00+00:00")  # before speculation's default
    older["levels"]["1"]["default"]["output_tokens_per_s"] = 77.7
    (results / "int8_serving_tiny_xeon_old.json").write_text(json.dumps(older))
    docs = tmp_path / "docs"
    loaded = report.write(results, docs)
    page = (docs / report.PAGE).read_text()

    assert ("int8_serving_tiny_nocpu.json", "no CPU name in the JSON") in loaded.skipped
    assert "`int8_serving_tiny_nocpu.json`: skipped, no CPU name in the JSON" in page
    assert all(r.file != "int8_serving_tiny_nocpu.json" for r in loaded.runs)
    # Each table's caption: CPU, model, sampling, speculation, and the file it came from.
    xeon = page[page.index("## Intel Xeon Processor"):]
    assert "CPU: **Intel Xeon Processor** · model: **tiny-shape-Q4_K_M (random weights)**" in xeon
    assert "sampling: greedy (temperature 0)" in xeon and "speculation: steadyserve auto (default); peers none" in xeon
    assert "`int8_serving_tiny_xeon.json`" in xeon and "77.7" not in xeon  # the latest run, not the older one
    # "AMD EPYC" names no generation: only the file's zen1 tag places it under Zen 1.
    assert "## AMD EPYC Zen 1 (AVX2 only) · tiny-shape-Q4_K_M (random weights)" in page
    svgs = sorted(p.name for p in (docs / report.IMG).glob("*.svg"))
    assert any("throughput" in n for n in svgs) and any("c1-bound" in n for n in svgs)
    figure = (docs / report.IMG / next(n for n in svgs if "intel" in n and "throughput" in n)).read_text()
    assert "Intel Xeon Processor · tiny-shape-Q4_K_M (random weights)" in figure and "greedy" in figure
    assert "speculation: steadyserve auto (default)" in figure
    # Deterministic: a second run writes the same bytes.
    again = generated(results, tmp_path / "again")
    assert again == {str(p.relative_to(docs)): p.read_text() for p in sorted(docs.rglob("*")) if p.is_file()}


def test_a_speculation_off_row_is_steadyserve_with_speculation_off_not_a_peer(tmp_path) -> None:
    """int8_serving's `speculation-off` row is steadyserve on default flags with --speculation off: c=1 figures are
    shown with speculation off beside the default, so the row must say so (not 'none (peer)')."""
    d = serving_run("Intel(R) Xeon(R) Processor", "2026-12-05T10:00+00:00")
    d["servers"]["speculation-off"] = {"command": "steadyserve serve --speculation off"}
    for lv in d["levels"].values():
        lv["speculation-off"] = dict(lv["default"])
    results = tmp_path / "results"
    results.mkdir()
    (results / "int8_serving_tiny_xeon.json").write_text(json.dumps(d))
    report.write(results, tmp_path / "docs")
    page = (tmp_path / "docs" / report.PAGE).read_text()
    assert "| speculation-off | off |" in page and "| llama-server | none (peer) |" in page
    assert "speculation: steadyserve auto (default), off; peers none" in page
