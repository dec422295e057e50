"""How much memory this process may use, and whether weights + KV cache + overhead fit in it.

The effective limit is the smallest of three terms, each read once at start-up:

* the cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`, of the process's own cgroup (found through
  /proc/self/cgroup and /proc/self/mountinfo) and of its ancestors up to the mount, since a parent's limit
  binds its children too; `max` (v2) and the v1 "no limit" value (~2^63) count as no limit;
* MemAvailable (/proc/meminfo) plus this process's own RSS: what the machine can still give us, plus what
  we already hold;
* the operator's `--memory-limit`.

Pure Python (no torch import): `tensor_bytes` recognises tensors by duck typing so it can be tested, and
kept working, whatever objects the loader stores its weights in.

TEST-ONLY root override: every file is read under `root` (default "/"). Tests pass `root=` to
`read_memory_limit`, or start a real server through `python -m steadyserve.testing.serve
--test-memory-root DIR`, which calls `set_test_root`; the production entry point never does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cgroups import cgroup_dir, cgroup_mounts, own_cgroups, read_file
from .config import ConfigError

MiB = 1024**2
# Documented overhead (docs/deploy.md, "Sizing memory"): interpreter, torch, transformers and gRPC
# (~270 MiB), tokenizer and load-time copies (~130 MiB), activations and allocator slack; measured RSS
# of SmolLM2 beyond weights + KV was ~680 MiB, so 768 MiB keeps a margin. --memory-overhead overrides it.
DEFAULT_OVERHEAD = 768 * MiB
# `auto` leaves this share of the limit unbudgeted, so steady-state RSS stays under the
# SteadyserveMemoryNearLimit alert (90%) unless the overhead was underestimated.
AUTO_HEADROOM = 0.10
# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX * page size (9223372036854771712 on x86-64): any value
# this large is no limit, not a number to size from.
UNLIMITED = 1 << 62

SOURCE_CGROUP2 = "cgroup v2 memory.max"
SOURCE_CGROUP1 = "cgroup v1 memory.limit_in_bytes"
SOURCE_MEMINFO = "MemAvailable + RSS"
SOURCE_FLAG = "--memory-limit"

_test_root: Path | None = None  # set only by steadyserve.testing.serve (--test-memory-root)


def set_test_root(path: str | Path | None) -> None:
    """TEST-ONLY: read /proc and /sys/fs/cgroup under `path` from now on (None restores "/")."""
    global _test_root
    _test_root = Path(path) if path else None


class MemoryBudgetError(ConfigError):
    """Weights + KV budget + overhead do not fit the limit. The message is one line naming every term; like
    any ConfigError, the command line prints it and exits 2 before serving."""


@dataclass(frozen=True)
class LimitTerm:
    source: str  # one of the SOURCE_* names
    limit: int | None  # bytes; None when this term sets no limit ("max", unlimited, file absent)
    detail: str  # the file it was read from, or why it sets no limit


@dataclass(frozen=True)
class MemoryLimit:
    limit: int  # the effective limit in bytes: the smallest term; 0 when no term could be read
    source: str  # the SOURCE_* of the smallest term; "unknown" when none
    detail: str  # that term's file or value, for logs and `steadyserve info`
    terms: tuple[LimitTerm, ...] = ()  # every term as read, smallest or not

    def as_dict(self) -> dict[str, Any]:
        return {"memory_limit_bytes": self.limit, "memory_limit_source": self.source}


def human(n: float) -> str:
    """Bytes as the largest binary unit that keeps the number >= 1, one decimal: `513.0 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- reading the limit ----------------------------------------------------------------------------------

def parse_limit_value(text: str) -> int | None:
    """A cgroup limit file's value in bytes; None for `max` or a v1 "unlimited" value."""
    value = text.strip()
    if value == "max":
        return None
    n = int(value)  # anything else in these files is a kernel bug; let it raise
    return None if n >= UNLIMITED else n


def _cgroup_term(root: Path, v2: bool, cg_path: str | None, mounts: list) -> LimitTerm:
    source, name = (SOURCE_CGROUP2, "memory.max") if v2 else (SOURCE_CGROUP1, "memory.limit_in_bytes")
    if cg_path is None:
        return LimitTerm(source, None, "not in /proc/self/cgroup")
    found = cgroup_dir(root, mounts, v2, cg_path)
    if found is None:
        return LimitTerm(source, None, "no cgroup mount")
    d, base = found
    best: tuple[int, Path] | None = None
    read_any = False
    while True:  # up to the mount point: an ancestor's limit binds us as well
        text = read_file(d, name)
        if text is not None:
            read_any = True
            value = parse_limit_value(text)
            if value is not None and (best is None or value < best[0]):
                best = (value, d / name)
        if d == base or base not in d.parents:
            break
        d = d.parent
    if best is None:
        return LimitTerm(source, None, f"{name}: no limit" if read_any else f"{name}: not found")
    return LimitTerm(source, best[0], "/" + str(best[1].relative_to(root)))


def _meminfo_term(root: Path) -> LimitTerm:
    text = read_file(root, "/proc/meminfo")
    if text is None:
        return LimitTerm(SOURCE_MEMINFO, None, "/proc/meminfo unreadable")
    fields = {k.strip(): v.split() for k, _, v in (line.partition(":") for line in text.splitlines())}
    if "MemAvailable" not in fields:
        return LimitTerm(SOURCE_MEMINFO, None, "no MemAvailable in /proc/meminfo")
    available = int(fields["MemAvailable"][0]) * 1024
    rss = 0
    for line in (read_file(root, "/proc/self/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return LimitTerm(SOURCE_MEMINFO, available + rss,
                     f"/proc/meminfo MemAvailable {human(available)} + own RSS {human(rss)}")


def read_memory_limit(operator_limit: int = 0, root: str | Path | None = None) -> MemoryLimit:
    """The effective memory limit: the smallest of the cgroup limit, MemAvailable + RSS and `--memory-limit`
    (`operator_limit`, 0 = none). `root` (TEST-ONLY) reads every file under it instead of "/"."""
    base = Path(root) if root is not None else (_test_root or Path("/"))
    own, mounts = own_cgroups(base), cgroup_mounts(base)
    terms = [_cgroup_term(base, True, own.get("v2"), mounts), _cgroup_term(base, False, own.get("memory"), mounts),
             _meminfo_term(base)]
    if operator_limit:
        terms.append(LimitTerm(SOURCE_FLAG, operator_limit, "the operator's flag"))
    known = [t for t in terms if t.limit is not None]
    if not known:
        return MemoryLimit(0, "unknown", "no cgroup limit, no /proc/meminfo, no --memory-limit", tuple(terms))
    best = min(known, key=lambda t: t.limit)  # type: ignore[arg-type, return-value]
    return MemoryLimit(best.limit or 0, best.source, best.detail, tuple(terms))


# ---- measuring the weights ------------------------------------------------------------------------------

def release_free_memory() -> None:
    """Hand memory that start-up freed back to the kernel: collect cycles, then glibc's malloc_trim.

    Loading frees tens of MiB in many small blocks (the GGUF reader's fields, tokenizer parsing) that glibc
    keeps mapped; a server's resident set would carry them for its whole life. Called after loading and
    after the self-test, before serving; without glibc it only collects."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        pass


def _is_tensor(obj: Any) -> bool:
    """A torch.Tensor (or Parameter), recognised without importing torch."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "nbytes") \
        and hasattr(obj, "untyped_storage")


# Never walked into: scalars, and code (a module's or function's globals are not the model's weights).
_LEAVES = (str, bytes, int, float, bool, complex, type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType)


def tensor_bytes(obj: Any, max_depth: int = 8) -> int:
    """Bytes of the distinct tensor storages reachable from `obj`: its attributes (vars() or __slots__),
    lists, tuples and dict values, and the same in the objects they hold, `max_depth` levels down.

    Each storage counts once (keyed by its data pointer), and whole: tied embeddings and views of one
    buffer are one allocation. Objects are matched by what they hold, not their type, so weights stored as
    plain tensors, nn.Parameters, dataclasses of tensors or wrappers with a `.data` tensor all count. The default
    depth reaches a sparse layer's expert panels (model, layers, a layer, its MoeWeights, a list of experts, a
    QMatrix, its parts, a QWeight: its data tensor is the 8th level)."""
    seen_objs: set[int] = set()
    storages: dict[tuple[str, int], int] = {}

    def visit(o: Any, depth: int) -> None:
        if o is None or isinstance(o, _LEAVES) or id(o) in seen_objs:
            return
        seen_objs.add(id(o))
        if _is_tensor(o):
            try:
                st = o.untyped_storage()
                key, size = (str(o.device), st.data_ptr()), st.nbytes()
            except (RuntimeError, NotImplementedError):  # no plain storage (sparse, some subclasses)
                key, size = ("", id(o)), int(o.nbytes)
            storages[key] = max(storages.get(key, 0), size)
            return
        if depth >= max_depth:
            return
        if isinstance(o, dict):
            children = list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            children = list(o)
        elif dataclasses.is_dataclass(o):
            children = [getattr(o, f.name, None) for f in dataclasses.fields(o)]
        elif hasattr(o, "__dict__") or hasattr(type(o), "__slots__"):
            children = list(getattr(o, "__dict__", {}).values())
            children += [getattr(o, s, None) for s in getattr(type(o), "__slots__", ()) if isinstance(s, str)]
        else:
            return
        for c in children:
            visit(c, depth + 1)

    visit(obj, 0)
    return sum(storages.values())


# ---- the budget ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    limit: MemoryLimit  # the effective limit and where it came from
    weights: int  # bytes of the loaded model's tensors (tensor_bytes), measured, not estimated
    kv: int  # the KV budget in bytes: as given, or derived from the limit (then a whole number of blocks)
    overhead: int  # --memory-overhead: the runtime beyond weights and KV (documented in docs/deploy.md)
    kv_request: str  # --kv-cache-memory as configured: "256.0 MiB", "auto" or "0.5"
    derived: bool  # the KV budget was derived from the limit (auto or a fraction)
    on_host: bool  # weights and KV are in host memory (CPU); on a GPU only the overhead counts against it

    @property
    def total(self) -> int:
        """What the process needs of the limit."""
        return (self.weights + self.kv if self.on_host else 0) + self.overhead

    def terms(self) -> str:
        where = "" if self.on_host else " (weights and KV on the device, not counted)"
        asked = f"--kv-cache-memory {self.kv_request}" if self.derived else "--kv-cache-memory"
        return (f"weights {human(self.weights)} + KV cache {human(self.kv)} ({asked}) "
                f"+ overhead {human(self.overhead)} (--memory-overhead){where} = {human(self.total)}")

    def line(self) -> str:
        """One line for `steadyserve info` and the start-up log."""
        if not self.limit.limit:
            return f"{self.terms()}; limit unknown (not checked)"
        return f"{self.terms()} of limit {human(self.limit.limit)} ({self.limit.source}: {self.limit.detail})"


def _request_text(request: int | float | str) -> str:
    return request if isinstance(request, str) else repr(request) if isinstance(request, float) else human(request)


def plan_memory(limit: MemoryLimit, weights: int, overhead: int, request: int | float | str, bytes_per_block: int,
                on_host: bool = True) -> MemoryPlan:
    """Check (or derive) the KV budget against the limit.

    `request` is EngineConfig.kv_cache_memory: bytes (checked: weights + KV + overhead must fit), a fraction
    f in (0, 1] (KV = f x (limit - weights - overhead)), or "auto" (KV = limit - weights - overhead - 10% of
    the limit, the headroom the RSS alert watches). Raises MemoryBudgetError, one line, when it cannot fit."""
    derived = isinstance(request, (float, str))
    text = _request_text(request)
    L = limit.limit
    src = f"{limit.source}: {limit.detail}"
    if derived and not on_host:
        raise MemoryBudgetError(f"--kv-cache-memory {text} sizes the KV cache from the host memory limit, but the "
                                f"weights and KV cache are on the device: give a size, e.g. --kv-cache-memory 2GiB")
    if derived and not L:
        raise MemoryBudgetError(f"--kv-cache-memory {text} needs a memory limit, and none could be read "
                                f"({limit.detail}): set --memory-limit")
    if not derived:
        plan = MemoryPlan(limit, weights, int(request), overhead, text, False, on_host)
        if L and plan.total > L:
            raise MemoryBudgetError(f"memory budget does not fit: {plan.terms()} > limit {human(L)} ({src}); "
                                    "lower --kv-cache-memory or use --kv-cache-memory auto, serve a smaller model, "
                                    "or raise the limit")
        return plan
    left = L - weights - overhead
    want = left - int(L * AUTO_HEADROOM) if request == "auto" else int(left * float(request))
    kv = max(0, want) // bytes_per_block * bytes_per_block
    plan = MemoryPlan(limit, weights, kv, overhead, text, True, on_host)
    if kv < bytes_per_block:
        headroom = f" - headroom {human(L * AUTO_HEADROOM)} (10% of the limit)" if request == "auto" else ""
        share = "" if request == "auto" else f", x {text} = {human(want)},"
        raise MemoryBudgetError(
            f"memory budget does not fit: limit {human(L)} ({src}) - weights {human(weights)} - overhead "
            f"{human(overhead)} (--memory-overhead){headroom} leaves {human(left if share else want)}{share} "
            f"for the KV cache (--kv-cache-memory {text}), less than one block of {human(bytes_per_block)}; "
            "raise the limit or serve a smaller model")
    return plan
