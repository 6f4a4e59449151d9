"""The generated code in ftd/v1 is exactly what protos/generate.py makes from protos/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_regenerating_gives_what_the_package_uses(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("ftd_protos_generate", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.generate(tmp_path)
    assert written, "protoc wrote nothing"
    shipped = ROOT / "ftd" / "v1"
    names = {p.name for p in written}
    assert names == {p.name for p in shipped.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py"}
    for path in written:
        assert path.read_bytes() == (shipped / path.name).read_bytes(), f"{path.name} differs: run protos/generate.py"


def test_protos_live_under_a_versioned_package() -> None:
    from ftd.v1 import coordinator_pb2

    assert coordinator_pb2.DESCRIPTOR.package == "ftd.v1"
    assert coordinator_pb2.DESCRIPTOR.name == "ftd/v1/coordinator.proto"


def test_coordinator_and_ftctl_import_without_torch() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ftd.coordinator.main, ftd.ftctl.cli, ftd.agent.main\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
