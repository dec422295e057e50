"""The memory limit (issue 33), without a server: cgroup v1 and v2 files read from fixture trees through the
TEST-ONLY root override (`read_memory_limit(root=...)`), `max` and the v1 "unlimited" value, the weight walker,
and the budget check and `auto` sizing (steadyserve/memory.py). Real servers are in test_memory_server.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from steadyserve.cli import build_parser, config_from_args
from steadyserve.config import ConfigError
from steadyserve.memory import (AUTO_HEADROOM, SOURCE_CGROUP1, SOURCE_CGROUP2, SOURCE_FLAG, SOURCE_MEMINFO,
                                MemoryBudgetError, MemoryLimit, parse_limit_value, plan_memory, read_memory_limit,
                                tensor_bytes)

MiB, GiB = 1024**2, 1024**3
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 reports for "no limit" on x86-64


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def meminfo(available_kib: int = 64 * 1024**2, rss_kib: int = 100 * 1024) -> dict[str, str]:
    return {"proc/meminfo": f"MemTotal: {2 * available_kib} kB\nMemFree: 1 kB\nMemAvailable: {available_kib} kB\n",
            "proc/self/status": f"Name: python\nVmRSS:\t{rss_kib} kB\n"}


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def test_v2_limit_of_own_cgroup_found_through_proc_self_cgroup(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "0::/kubepods/pod1/ctr\n", "proc/self/mountinfo": V2_MOUNT,
                           "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "1677721600\n",
                           "sys/fs/cgroup/kubepods/memory.max": "max\n",  # an ancestor without a limit
                           **meminfo()})
    lim = read_memory_limit(root=root)
    assert (lim.limit, lim.source) == (1600 * MiB, SOURCE_CGROUP2)
    assert lim.detail == "/sys/fs/cgroup/kubepods/pod1/ctr/memory.max"
    assert {t.source: t.limit for t in lim.terms}[SOURCE_MEMINFO] == (64 * 1024**2 + 100 * 1024) * 1024


def test_v2_parent_limit_binds_and_max_is_no_limit(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "0::/a/b\n", "proc/self/mountinfo": V2_MOUNT,
                           "sys/fs/cgroup/a/b/memory.max": "max\n", "sys/fs/cgroup/a/memory.max": "2147483648\n",
                           **meminfo()})
    assert read_memory_limit(root=root).limit == 2 * GiB  # the parent's limit applies to us
    (root / "sys/fs/cgroup/a/memory.max").write_text("max\n")
    lim = read_memory_limit(root=root)
    assert lim.source == SOURCE_MEMINFO  # nothing set: the machine's memory is the limit
    assert {t.source: t for t in lim.terms}[SOURCE_CGROUP2].limit is None


def test_v2_namespaced_mount_shows_our_cgroup_as_its_root(tmp_path):
    """Docker / Kubernetes with a cgroup namespace: /proc/self/cgroup says `0::/`, files are at the mount."""
    root = tree(tmp_path, {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT,
                           "sys/fs/cgroup/memory.max": "536870912\n", **meminfo()})
    assert read_memory_limit(root=root).limit == 512 * MiB


def test_v1_limit_with_mount_root_and_unlimited(tmp_path):
    """cgroup v1, Docker without a namespace: the memory controller's mount root is the container's path."""
    mount = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    root = tree(tmp_path, {"proc/self/cgroup": "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
                           "proc/self/mountinfo": mount,
                           "sys/fs/cgroup/memory/memory.limit_in_bytes": "1073741824\n", **meminfo()})
    lim = read_memory_limit(root=root)
    assert (lim.limit, lim.source) == (GiB, SOURCE_CGROUP1)
    assert lim.detail == "/sys/fs/cgroup/memory/memory.limit_in_bytes"
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(V1_UNLIMITED + "\n")
    lim = read_memory_limit(root=root)
    assert lim.source == SOURCE_MEMINFO and {t.source: t for t in lim.terms}[SOURCE_CGROUP1].limit is None


def test_v1_without_mountinfo_uses_the_conventional_mount(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "4:memory:/process_api/x\n",
                           "sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes": "805306368\n",
                           "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED, **meminfo()})
    assert read_memory_limit(root=root).limit == 768 * MiB


def test_smallest_term_wins_including_the_operator(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT,
                           "sys/fs/cgroup/memory.max": str(4 * GiB), **meminfo(available_kib=1024**2, rss_kib=0)})
    assert read_memory_limit(root=root).source == SOURCE_MEMINFO  # 1 GiB available < 4 GiB cgroup
    lim = read_memory_limit(512 * MiB, root=root)
    assert (lim.limit, lim.source) == (512 * MiB, SOURCE_FLAG)
    assert read_memory_limit(8 * GiB, root=root).limit == GiB  # the operator cannot raise the limit


def test_nothing_readable_is_unknown(tmp_path):
    lim = read_memory_limit(root=tmp_path)
    assert (lim.limit, lim.source) == (0, "unknown")


def test_parse_limit_value():
    assert parse_limit_value("max\n") is None and parse_limit_value(V1_UNLIMITED) is None
    assert parse_limit_value(" 1048576\n") == MiB


# ---- the weights ----------------------------------------------------------------------------------------

class _Wrapped:
    """Like the GGUF weights the loader may store: a uint8 tensor inside a small object."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.kind = "q4_0"


@dataclasses.dataclass
class _Layer:
    wq: object
    norm: torch.Tensor


def test_tensor_bytes_counts_each_storage_once_whatever_holds_it():
    embed = torch.zeros(100, 8)  # 3200 B
    model = type("M", (), {})()
    model.embed, model.lm_head = embed, embed  # tied: one storage
    model.lm_head_parts = embed.split(30)  # views of it: still one
    model.layers = [_Layer(_Wrapped(torch.zeros(1000, dtype=torch.uint8)), torch.zeros(4)) for _ in range(3)]
    model.config = {"name": "x", "rope": torch.zeros(2, 2, dtype=torch.float64)}  # 32 B
    model.param = torch.nn.Parameter(torch.zeros(10))  # 40 B
    assert tensor_bytes(model) == 3200 + 3 * (1000 + 16) + 32 + 40
    assert tensor_bytes(torch.nn.Linear(4, 2)) == (8 + 2) * 4  # nn.Modules too, through their dicts


# ---- the budget -----------------------------------------------------------------------------------------

def limit(n: int, source: str = SOURCE_CGROUP2) -> MemoryLimit:
    return MemoryLimit(n, source, "/sys/fs/cgroup/memory.max")


def test_explicit_budget_that_fits_is_kept_and_one_that_does_not_is_refused_in_one_line():
    p = plan_memory(limit(2 * GiB), weights=500 * MiB, overhead=768 * MiB, request=256 * MiB, bytes_per_block=16384)
    assert (p.kv, p.derived, p.total) == (256 * MiB, False, 1524 * MiB)
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(limit(GiB), weights=500 * MiB, overhead=768 * MiB, request=256 * MiB, bytes_per_block=16384)
    msg = str(e.value)
    assert "\n" not in msg
    for term in ("weights 500.0 MiB", "KV cache 256.0 MiB", "overhead 768.0 MiB", "limit 1.0 GiB",
                 SOURCE_CGROUP2, "/sys/fs/cgroup/memory.max"):
        assert term in msg, (term, msg)


def test_auto_on_a_small_fixture_limit_gives_the_expected_blocks():
    bpb = 2 * 2 * 2 * 16 * 32 * 4  # tiny Llama: 2 layers, 2 KV heads, head dim 16, 32-token blocks, float32
    p = plan_memory(limit(1200 * MiB), weights=449 * 1024, overhead=768 * MiB, request="auto", bytes_per_block=bpb)
    expected = (1200 * MiB - 449 * 1024 - 768 * MiB - int(1200 * MiB * AUTO_HEADROOM)) // bpb
    assert p.kv == expected * bpb and expected == 19939
    assert p.total <= 1200 * MiB * (1 - AUTO_HEADROOM)  # auto leaves the alert's 10% alone
    half = plan_memory(limit(1200 * MiB), weights=449 * 1024, overhead=768 * MiB, request=0.5, bytes_per_block=bpb)
    assert half.kv == (1200 * MiB - 449 * 1024 - 768 * MiB) // 2 // bpb * bpb


def test_auto_that_leaves_no_block_is_refused_by_name():
    with pytest.raises(MemoryBudgetError, match=r"leaves .* less than one block.*") as e:
        plan_memory(limit(800 * MiB), weights=100 * MiB, overhead=768 * MiB, request="auto", bytes_per_block=16384)
    assert "--kv-cache-memory auto" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(MemoryBudgetError, match="needs a memory limit"):
        plan_memory(MemoryLimit(0, "unknown", "none"), 0, 0, "auto", 16384)
    with pytest.raises(MemoryBudgetError, match="on the device"):
        plan_memory(limit(GiB), 0, 0, 0.5, 16384, on_host=False)


def serve_cfg(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_flags_parse_and_bad_values_are_refused_by_name():
    e = serve_cfg("--kv-cache-memory", "auto", "--memory-limit", "2GiB", "--memory-overhead", "1GiB").engine
    assert (e.kv_cache_memory, e.memory_limit, e.memory_overhead) == ("auto", 2 * GiB, GiB)
    assert serve_cfg("--kv-cache-memory", "0.5").engine.kv_cache_memory == 0.5
    assert serve_cfg("--kv-cache-memory", "1000000").engine.kv_cache_memory == 1000000
    assert serve_cfg().engine.memory_limit == 0
    for flags, match in ((["--kv-cache-memory", "1.5"], r"--kv-cache-memory: a fraction must be in \(0, 1\]"),
                         (["--kv-cache-memory", "0.0"], r"--kv-cache-memory: a fraction"),
                         (["--kv-cache-memory", "lots"], "--kv-cache-memory: cannot parse 'lots'"),
                         (["--memory-limit", "garbage"], "--memory-limit: cannot parse size 'garbage'"),
                         (["--memory-overhead", "-1"], "--memory-overhead: cannot parse")):
        with pytest.raises(ConfigError, match=match):
            serve_cfg(*flags)
