"""What the KV layout (engine/kv_layout.py) saves: the KV bytes a sequence holds, and the tokens a cache budget
holds, with one block table for every layer (the layout before hybrid groups) and with the model's groups.

Arithmetic from the engine's own BlockManager and KV sizes, not a timing: for each GGUF, the layers' windows from
its config, then for a budget and the default step budget the longest sequence that fits alone
(BlockManager.token_capacity) and the bytes one sequence of each length holds at its peak.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/kv_layout_capacity.py --model FILE [--model FILE ...]
        --kv-cache-memory 1GiB --out benchmarks/results/kv_layout_capacity.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from steadyserve.config import EngineConfig, parse_size
from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.kv_cache import bytes_per_block, kv_layout
from steadyserve.engine.kv_layout import plan_kv_layout
from steadyserve.models.loader import _read_config, convert_gguf
from steadyserve.models.registry import model_args


def one_model(path: Path, budget: int, fmt: str, lengths: list[int]) -> dict:
    model_dir, _ = convert_gguf(path, with_weights=False, native=True)
    args = model_args(_read_config(model_dir, True))
    cfg = EngineConfig()
    groups = kv_layout(args)  # the engine's own layout
    per_layer_block = bytes_per_block(args, cfg.block_size, fmt) // groups.group_size  # K and V, one layer
    windows = sorted(set(groups.windows))
    out: dict = {"gguf": path.name, "layers": args.num_layers, "windows": windows, "kv_dtype": fmt,
                 "block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    # one group, as before the layout: behind the largest window when every layer has one, else full attention
    one = plan_kv_layout([max(windows) if 0 not in windows else 0] * args.num_layers)
    for name, layout in (("one_table", one), ("groups", groups)):
        block_bytes = per_layer_block * layout.group_size
        bm = BlockManager(max(1, budget // block_bytes), cfg.block_size, windows=layout.windows,
                          max_step_tokens=cfg.max_num_batched_tokens)
        out[name] = {"groups": list(layout.windows), "layers_per_group": layout.group_size,
                     "block_bytes": block_bytes, "blocks": bm.num_blocks,
                     "token_capacity": bm.token_capacity(args.max_position_embeddings),
                     "bytes_held_at_length": {str(n): bm.blocks_held_at_most(n) * block_bytes for n in lengths}}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="a GGUF file (repeatable)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--kv-cache-dtype", default="f16", help="the int8 path's default cache format")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    budget = parse_size(a.kv_cache_memory, "--kv-cache-memory")
    res = {"kv_cache_memory": a.kv_cache_memory, "models": [one_model(Path(m), budget, a.kv_cache_dtype,
                                                                     [1024, 4096, 16384, 32768])
                                                           for m in a.model]}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
