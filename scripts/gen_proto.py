"""Regenerate the committed protobuf/gRPC code in proto/v1 from the .proto files.

    python scripts/gen_proto.py           # write proto/v1/*_pb2*.py(i)
    python scripts/gen_proto.py --check   # exit 1 if the committed code has drifted

Generating with --proto_path=gpumarket/proto=proto gives absolute imports
(``from gpumarket.proto.v1 import types_pb2``) that work with the package-dir mapping.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "v1"


def generate(out: Path) -> list[Path]:
    """Run protoc into ``out``; return the generated files (relative to out/gpumarket/proto/v1)."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted(f"gpumarket/proto/v1/{p.name}" for p in PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        "--proto_path=gpumarket/proto=proto",
        f"--proto_path={include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    code = protoc.main(args)
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    gen = out / "gpumarket" / "proto" / "v1"
    return sorted(p for p in gen.iterdir() if p.suffix in {".py", ".pyi"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed code differs")
    args = parser.parse_args()
    import os

    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        drifted = []
        for f in files:
            target = PROTO_DIR / f.name
            if args.check:
                if not target.exists() or not filecmp.cmp(f, target, shallow=False):
                    drifted.append(target.relative_to(ROOT))
            else:
                shutil.copyfile(f, target)
        if args.check:
            names = {f.name for f in files}
            stale = [p for p in PROTO_DIR.glob("*_pb2*.py*") if p.name not in names]
            drifted += [p.relative_to(ROOT) for p in stale]
            if drifted:
                print("generated protocol code is out of date: " + ", ".join(map(str, drifted)))
                print("run: python scripts/gen_proto.py")
                return 1
            print(f"generated protocol code matches ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
