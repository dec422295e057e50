"""The rule for the --no-batch-invariant (plain) path, shared by the engine and the over-the-wire invariance tests.

Batch invariance off promises nothing, so a plain path that happens not to drift on this CPU (its MKL / kernels
give the same bits whatever the batch) is not a failure: it is reported, in a warning naming the machine,
because then the invariant-path checks have no natural drift to catch here (their 'broken' / drift-server
variants still show they catch an injected one). What every CPU promises is still asserted by the callers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from steadyserve.platform_info import platform_info


def no_plain_drift_message(claim: str, cases: list) -> str:
    p = platform_info()
    return (f"no plain-path drift found for {claim} over {len(cases)} cases {cases} on {p.cpu_model} "
            f"(isa {p.isa}, MKL {p.mkl_version}, MKL_CBWR={p.mkl_cbwr or 'unset'}): the invariant-path check has "
            f"no natural drift to catch on this machine (the broken/drift variant still shows it catches an "
            f"injected one)")


def report_plain_search(claim: str, results: Mapping[str, float | bool]) -> bool:
    """Report, never assert, what a search of the plain path found. `results`: {case: max |logprob diff|
    (0.0 = bitwise equal)} or {case: drifted?}. Returns whether any case drifted; warns, naming the platform,
    when none did. Asserts only that the search compared something."""
    assert results, f"the plain-path search for {claim} compared no case"
    assert all(isinstance(v, bool) or v >= 0.0 for v in results.values()), results
    print(f"\nplain ({claim}): per case: " + ", ".join(
        f"{k}={'drift' if v else 'equal'}" if isinstance(v, bool) else f"{k}={v:.3g}" for k, v in results.items()))
    found = any(bool(v) for v in results.values())
    if not found:
        warnings.warn(no_plain_drift_message(claim, sorted(results)))
    return found
