"""Regenerates the committed Python code from the .proto files.

    python -m protos.generate          # write the *_pb2.py / *_pb2_grpc.py / *.pyi files
    python -m protos.generate --check  # exit 1 if the committed code is stale

The generated modules live beside their .proto files under protos/rlmesh/ and are installed as
the top-level package `rlmesh` (see pyproject.toml), so `from rlmesh.rollout.v1 import rollout_pb2`.
"""

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[pathlib.Path]:
    return sorted(PROTO_ROOT.glob("rlmesh/**/*.proto"))


def generate_into(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc (grpcio-tools) on every .proto file; returns the written files."""
    from grpc_tools import protoc
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return [p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES)]


def package_dirs(rel: pathlib.Path) -> list[pathlib.Path]:
    """rlmesh/rollout/v1/x_pb2.py -> [rlmesh/rollout/v1, rlmesh/rollout, rlmesh]: each needs an __init__.py."""
    return [d for d in rel.parents if str(d) != "."]


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        fresh = {p.relative_to(tmp) for p in generate_into(tmp)}
        committed = {p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*")
                     if p.name.endswith(GENERATED_SUFFIXES)}
        stale = sorted(str(r) for r in fresh if not (PROTO_ROOT / r).exists()
                       or not filecmp.cmp(tmp / r, PROTO_ROOT / r, shallow=False))
        extra = sorted(str(r) for r in committed - fresh)
        if args.check:
            if stale or extra:
                print("generated code is stale; run `python -m protos.generate`:", *stale, *extra, sep="\n  ")
                return 1
            return 0
        for rel in fresh:
            (PROTO_ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp / rel, PROTO_ROOT / rel)
            for pkg in package_dirs(rel):
                (PROTO_ROOT / pkg / "__init__.py").touch()
        for rel in extra:
            (PROTO_ROOT / rel).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
