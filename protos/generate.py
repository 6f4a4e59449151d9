"""Regenerates the Python code under ``ftd/v1`` from the ``.proto`` files in this folder.

Run from anywhere: ``python protos/generate.py [--out DIR]``. ``tests/test_protos.py`` runs it into a
temporary folder and compares byte for byte with what the package ships, so the generated code can
never drift from its source.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_FILES = sorted(p.relative_to(HERE).as_posix() for p in (HERE / "ftd" / "v1").glob("*.proto"))


def _plugin(name: str) -> str:
    """Finds a protoc plugin installed beside this interpreter first, then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"protoc plugin {name!r} not found: pip install 'ftd[dev]' (mypy-protobuf)")
    return found


def generate(out: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) into ``out``; returns the files written."""
    from grpc_tools import protoc  # dev dependency only, pinned in pyproject for byte-exact output

    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{HERE}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        # Typed stubs for messages and services come from mypy-protobuf's plugins.
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *PROTO_FILES,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_FILES}")
    return sorted(p for p in (out / "ftd" / "v1").iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE.parent, help="root to write ftd/v1/ under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
