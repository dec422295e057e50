"""`steadyserve verify RECEIPT...`: replay receipts offline and prove each response bit for bit, or say where not.

Each file holds one receipt, a list of them, `{"receipts": [...]}` (a conformance file), a response body
whose choices carry receipts, a WebSocket final message, or one JSON value per line. Exit status: 0 when
every receipt verified; 1 when any did not (a mismatch, an unreadable receipt); 3 when none mismatched but
some are not reproducible on this machine; 2 for usage errors (no receipts found).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..receipts.format import Receipt, ReceiptError, parse
from ..receipts.replay import INVALID, MISMATCH, NOT_REPRODUCIBLE, VERIFIED, Verdict, verify

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_NOT_REPRODUCIBLE = 0, 1, 2, 3


def receipts_in(value: Any) -> list[Any]:
    """The receipt objects a JSON value holds, in order (see the module docstring for the shapes)."""
    if isinstance(value, list):
        return [r for v in value for r in receipts_in(v)]
    if not isinstance(value, dict):
        return []
    if "receipt_version" in value:
        return [value]
    if isinstance(value.get("receipts"), list):
        return receipts_in(value["receipts"])
    if isinstance(value.get("receipt"), (dict, str)):  # a WebSocket final message, a choice, a gRPC final
        r = value["receipt"]
        return [json.loads(r) if isinstance(r, str) else r]
    if isinstance(value.get("choices"), list):
        return [r for c in value["choices"] for r in receipts_in(c)]
    return []


def read_file(path: str) -> list[tuple[str, Any]]:
    """(source label, receipt object) for each receipt in the file. Raises OSError, ValueError."""
    text = Path(path).read_text() if path != "-" else sys.stdin.read()
    try:
        found = receipts_in(json.loads(text))
    except json.JSONDecodeError:
        found = [r for line in text.splitlines() if line.strip() for r in receipts_in(json.loads(line))]
    if len(found) == 1:
        return [(path, found[0])]
    return [(f"{path}#{i}", r) for i, r in enumerate(found)]


def collect(paths: list[str]) -> tuple[list[tuple[str, Receipt]], list[Verdict]]:
    """Parsed receipts, and a Verdict for each file or receipt that could not be read."""
    ok: list[tuple[str, Receipt]] = []
    bad: list[Verdict] = []
    for path in paths:
        try:
            items = read_file(path)
        except (OSError, ValueError) as e:
            bad.append(Verdict(path, INVALID, f"cannot read: {e}"))
            continue
        if not items:
            bad.append(Verdict(path, INVALID, "no receipt in this file"))
        for src, obj in items:
            try:
                ok.append((src, parse(obj)))
            except ReceiptError as e:
                bad.append(Verdict(src, INVALID, f"not a receipt: {e}"))
    return ok, bad


def exit_status(verdicts: list[Verdict]) -> int:
    if not verdicts:
        return EXIT_USAGE
    if any(v.status in (MISMATCH, INVALID) for v in verdicts):
        return EXIT_MISMATCH
    if any(v.status == NOT_REPRODUCIBLE for v in verdicts):
        return EXIT_NOT_REPRODUCIBLE
    return EXIT_OK


def summary(verdicts: list[Verdict]) -> dict[str, Any]:
    counts = {s: sum(v.status == s for v in verdicts) for s in (VERIFIED, MISMATCH, NOT_REPRODUCIBLE, INVALID)}
    return {"receipts": len(verdicts), **counts, "passed": exit_status(verdicts) == EXIT_OK}


def print_verdicts(verdicts: list[Verdict]) -> None:
    for v in verdicts:
        rid = f" {v.request_id}[{v.choice}]" if v.request_id else ""
        line = f"{v.status.upper():<22} {v.source}{rid}"
        if v.status == VERIFIED:
            line += f" (numerics {v.numerics})"
        print(line)
        if v.detail:
            print(f"    {v.detail}")
    s = summary(verdicts)
    print(f"{s['receipts']} receipt(s): {s[VERIFIED]} verified, {s[MISMATCH]} mismatched, "
          f"{s[NOT_REPRODUCIBLE]} not reproducible here, {s[INVALID]} invalid")


def main(a: Any) -> int:
    receipts, verdicts = collect(a.receipts)
    if not receipts and not verdicts:
        print("steadyserve verify: no receipts given", file=sys.stderr)
        return EXIT_USAGE
    log = (lambda m: print(f"steadyserve verify: {m}", file=sys.stderr)) if not a.json else (lambda _: None)
    order = {src: i for i, src in enumerate(src for src, _ in receipts)}
    verdicts += verify(receipts, model=a.model or "", threads=a.threads, batched=not a.one_at_a_time, log=log)
    verdicts.sort(key=lambda v: order.get(v.source, -1))
    if a.json:
        print(json.dumps({"summary": summary(verdicts), "receipts": [v.as_dict() for v in verdicts]}, indent=2))
    else:
        print_verdicts(verdicts)
    return exit_status(verdicts)
