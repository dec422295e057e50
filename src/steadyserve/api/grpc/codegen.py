"""Regenerate the Python gRPC stubs from proto/steadyserve/v1/*.proto (`make proto`).

    python -m steadyserve.api.grpc.codegen            # write src/steadyserve/api/protos/...
    python -m steadyserve.api.grpc.codegen --check    # exit 1 if the checked-in stubs are stale

protoc runs with `-I proto`, so the descriptors keep their canonical name
(`steadyserve/v1/inference.proto`, what reflection shows). protoc's Python
plugin then writes absolute imports (`from steadyserve.v1 import ...`) that
would resolve against our own `steadyserve` package; they are rewritten to
relative imports. The messages' module name (`steadyserve.v1.inference_pb2`, which
cannot be imported) becomes the module's real name, so that the messages pickle (Ray
Serve's gRPC proxy pickles each request to its replica). Those are the only two edits
made to protoc's output.

This is a development action: it needs grpcio-tools (a test extra); the
server itself imports only grpcio and protobuf.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]  # src/steadyserve/api/grpc/codegen.py -> repo root
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "src" / "steadyserve" / "api" / "protos"
PROTO_FILES = ("steadyserve/v1/inference.proto",)

_ABS_IMPORT = re.compile(r"^from steadyserve\.v1 import (\w+) as (\w+)$", re.MULTILINE)
_MODULE_NAME = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'[\w.]+'")
# Lines that name the generator's version, not the proto's content: the staleness check ignores
# them so a patch-level grpcio-tools difference between machines is not reported as stale stubs.
_VERSION_LINES = re.compile(r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|"
                            r"\s*\d+,\s*$|\s*'',\s*$)", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into `out_dir` (which gets the steadyserve/v1/ tree); returns the files written."""
    from grpc_tools import protoc  # dev dependency, imported only here
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")  # google/protobuf/*.proto
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        pkg_dir = out_dir / Path(proto).parent
        d = pkg_dir
        while True:  # every directory down to the stubs is a package, so they import as modules
            if not (d / "__init__.py").exists():
                (d / "__init__.py").write_text("")
            if d == out_dir:
                break
            d = d.parent
        stem = Path(proto).stem
        for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"):
            path = pkg_dir / name
            text = _ABS_IMPORT.sub(r"from . import \1 as \2", path.read_text())
            path.write_text(_MODULE_NAME.sub(r"\1__name__", text))
            written.append(path)
    return written


def _normalized(text: str) -> str:
    return _VERSION_LINES.sub("", text)


def stale_files() -> list[str]:
    """Generated files that differ from a fresh protoc run (ignoring generator version lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            rel = path.relative_to(tmp)
            checked_in = OUT_DIR / rel
            if not checked_in.exists() or _normalized(checked_in.read_text()) != _normalized(path.read_text()):
                stale.append(str(rel))
        return stale


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        stale = stale_files()
        if stale:
            print("stale generated stubs (run `make proto`): " + ", ".join(stale), file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0
    for path in generate(OUT_DIR):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
