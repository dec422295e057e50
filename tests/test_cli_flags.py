"""The `serve` flags are generated from the config tree (config.py: a field with `flag(...)` metadata is one option):
one default, one list of choices and one check per flag, and a flag added as one config field is a working option,
in --help and in the docs reference (docs/docgen.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from steadyserve import cli
from steadyserve.config import Config, ConfigError, EngineConfig, ServerConfig, flag, flag_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
import docgen  # noqa: E402


def serve_parser(parser=None):
    return (parser or cli.build_parser())._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]


def test_no_flag_given_is_the_config_trees_defaults(monkeypatch) -> None:
    """One default per flag: the parser's is the field's (--kv-cache-memory included: 256 MiB, once)."""
    monkeypatch.delenv("STEADYSERVE_API_KEY", raising=False)
    assert cli.config_from_args(cli.build_parser().parse_args(["serve"])) == Config()
    assert EngineConfig().kv_cache_memory == 256 * 1024**2
    help_text = serve_parser().format_help()
    assert "(default: 256MiB)" in help_text and "(default: 768MiB)" in help_text


def test_every_flagged_field_is_one_option_and_every_option_one_field() -> None:
    options = {o for a in serve_parser()._actions for o in a.option_strings if o != "--help" and o != "-h"}
    flagged = set()
    for _, section in cli.config_sections():
        for f in dataclasses.fields(section):
            spec = flag_of(f)
            assert spec is not None, f"{section.__name__}.{f.name} has no flag"
            flagged |= {spec.name, "--no-" + spec.name[2:]} if spec.negatable else {spec.name}
    assert options == flagged


def test_choices_are_checked_once_by_the_config(monkeypatch) -> None:
    """The parser shows the choices but does not check them: config.check_choices does, for the CLI and for a
    Config built in code alike, with one wording."""
    parsed = cli.build_parser().parse_args(["serve", "--attention", "triton"])
    with pytest.raises(ConfigError, match=r"^--attention must be one of auto, native, python, not 'triton'$"):
        cli.config_from_args(parsed)
    with pytest.raises(ConfigError, match=r"^--attention must be one of auto, native, python, not 'triton'$"):
        EngineConfig(attention="triton").validate()
    assert cli.main(["serve", "--log-format", "xml"]) == cli.EXIT_USAGE


def test_a_flag_is_added_as_one_config_field(monkeypatch) -> None:
    """A new field with flag metadata (and nothing else) is an option with its help and default, parsed by its
    type into the config, and a row of the docs reference."""

    @dataclasses.dataclass
    class Server(ServerConfig):
        widgets: int = flag(7, name="--widgets", help="how many widgets (default: %(default)s)")

    @dataclasses.dataclass
    class Tree(Config):
        server: ServerConfig = dataclasses.field(default_factory=Server)

    monkeypatch.setattr(cli, "Config", Tree)
    parser = cli.build_parser()
    assert "how many widgets (default: 7)" in " ".join(serve_parser(parser).format_help().split())
    assert cli.config_from_args(parser.parse_args(["serve"])).server.widgets == 7
    assert cli.config_from_args(parser.parse_args(["serve", "--widgets", "9"])).server.widgets == 9
    monkeypatch.setattr("steadyserve.config.Config", Tree)
    monkeypatch.setattr(docgen, "_field_comments", lambda: {("server", "widgets"): "widgets per request"})
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    row = next(line for line in docgen.cli_reference().splitlines() if line.startswith("| `--widgets`"))
    assert "`7`" in row and "`server.widgets`" in row and "widgets per request" in row
