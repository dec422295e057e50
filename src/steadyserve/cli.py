"""`steadyserve` command line. The flags of `serve` (and `info`) are generated from config.Config: each field
with a Flag in its metadata is one option, so a flag is added in config.py alone."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import fields
from typing import Any, Sequence

from .config import Config, ConfigError, Flag, flag_of
from .tools.cli import add_tool_commands  # a real import: a broken tools package must fail loudly

EXIT_USAGE = 2


def config_sections() -> list[tuple[str, type]]:
    """(group title, section class) of the config tree, in --help's order: Config's own fields."""
    return [(f.name, type(getattr(Config(), f.name))) for f in fields(Config)]


def _dest(spec: Flag) -> str:
    return spec.name.removeprefix("--").replace("-", "_")


_TYPES = {"int": int, "float": float}  # a flag without its own parse takes its field's type (str otherwise)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One option per config field that has a Flag (config.py), in one argument group per section. The field's
    default is the option's; choices are shown here and checked by Config.validate (config.check_choices)."""
    for title, section in config_sections():
        g = p.add_argument_group(title)
        for f in fields(section):
            spec = flag_of(f)
            if spec is None:
                continue
            default = os.environ.get(spec.env, f.default) if spec.env else f.default
            help_ = spec.help.replace("%", "%%").replace("%%(default)s", spec.shown(default))
            if spec.sets_false:
                g.add_argument(spec.name, action="store_true", help=help_)
            elif spec.negatable:
                g.add_argument(spec.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
            else:
                kind = None if spec.parse else _TYPES.get(f.type if isinstance(f.type, str) else f.type.__name__)
                metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else None
                g.add_argument(spec.name, type=kind, default=default, metavar=metavar, help=help_)


def config_from_args(a: argparse.Namespace) -> Config:
    """The validated Config of parsed `serve` / `info` arguments: each flagged field from its option (text
    parsed by the Flag's parse), the others at their defaults. Raises ConfigError naming the flag."""
    sections: dict[str, Any] = {}
    for title, section in config_sections():
        values: dict[str, Any] = {}
        for f in fields(section):
            spec = flag_of(f)
            if spec is None:
                continue
            raw = getattr(a, _dest(spec))
            if spec.sets_false:
                values[f.name] = not raw
            elif spec.parse is not None and isinstance(raw, str):
                values[f.name] = spec.parse(raw, spec.name)
            else:
                values[f.name] = raw
        sections[title] = section(**values)
    cfg = Config(**sections)
    cfg.validate()
    return cfg


def cmd_serve(a: argparse.Namespace, hooks: Any = None) -> int:
    """Serve; `hooks` (api.server.EngineHooks) only from the test suite's entry point, steadyserve.testing.serve."""
    from .api.server import Server
    from .logs import setup_logging
    from .models.loader import LoadError

    cfg = config_from_args(a)
    setup_logging(cfg.server.log_format)
    server = Server(cfg, hooks)
    try:
        server.load()
    except LoadError as e:
        print(f"steadyserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(server.serve())


def cmd_info(a: argparse.Namespace) -> int:
    """Load the model, run the self-test, print what a server would stamp on its responses."""
    from .api.startup import build_state
    from .logs import setup_logging
    from .models.loader import LoadError

    setup_logging("text")
    cfg = config_from_args(a)
    try:
        state = build_state(cfg)
    except LoadError as e:
        print(f"steadyserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    lm = state.loaded
    print(f"model         {lm.name} ({lm.args.architecture}, {lm.args.num_params / 1e6:.1f}M params)")
    print(f"fingerprint   {state.fingerprint}")
    print(f"context       {state.limits.context} tokens")
    print(f"kv cache      {state.limits.kv_blocks} blocks x {state.limits.block_size} tokens")
    print(f"self-test     {state.selftest.detail if state.selftest else 'skipped (batch invariance off)'}")
    print(f"load time     {lm.load_seconds:.2f} s ({'cached' if lm.from_cache else 'converted' if lm.from_cache is False and str(lm.name).endswith('gguf') else 'read'})")
    from .platform_info import platform_info, row_tiles_of

    for label, value in platform_info(row_tiles_of(lm), state.memory.limit, state.cpu).lines():
        print(f"{label:<14}{value}")
    print(f"{'memory':<14}{state.memory.line()}")
    return 0 if (state.selftest is None or state.selftest.passed) else 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steadyserve", description="A language-model server that stays correct under load.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("serve", cmd_serve, "serve a model over HTTP and gRPC"),
                            ("info", cmd_info, "load a model, run the self-test, print its fingerprint")):
        sp = sub.add_parser(name, help=help_)
        add_config_flags(sp)
        sp.set_defaults(fn=fn)
    add_tool_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except ConfigError as e:
        print(f"steadyserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    from .process_exit import exit_process

    exit_process(main())
