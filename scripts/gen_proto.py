"""Regenerate the committed protobuf/gRPC code under devplugin_sdk/api from its .proto files.

Usage: python scripts/gen_proto.py [--check] [OUTPUT_ROOT]

Two pinned generators, each from its own locked environment, make the output reproducible:
- protoc and the gRPC plugin come from grpcio-tools 1.62.3 (protoc 25.1) in `.venv-gen`
  (requirements/gen.txt, made by ./scripts/test). Its code checks no runtime version at import,
  so it runs on protobuf 4.25.1 to 7.x and grpcio 1.62 onwards; code from a newer protoc refuses
  a runtime older than itself, or two majors newer.
- the type stubs come from mypy-protobuf (the dev group), run beside this Python. Its own code
  needs protobuf >= 5.26, which grpcio-tools 1.62 cannot install beside it: hence two
  environments, each protoc plugin being a process of its own.
The include root is the repository root, so generated imports are package-absolute
(`from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2`).
--check regenerates into a temporary directory and exits 1 naming every file that differs;
tests/api/test_generated.py does the same.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = (
    "devplugin_sdk/api/deviceplugin/v1beta1/deviceplugin.proto",
    "devplugin_sdk/api/pluginregistration/v1/pluginregistration.proto",
    "devplugin_sdk/api/dra/v1/dra.proto",
    "devplugin_sdk/api/dra/v1beta1/dra.proto",
    "devplugin_sdk/api/dra_health/v1/dra_health.proto",
    "devplugin_sdk/api/dra_health/v1alpha1/dra_health.proto",
)
# The generator environment's Python; GEN_PYTHON overrides it.
GEN_PYTHON = Path(os.environ.get("GEN_PYTHON", ROOT / ".venv-gen" / "bin" / "python"))


def _plugin(name: str) -> str:
    """Absolute path of a protoc plugin installed beside this Python (e.g. in the venv)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found beside {sys.executable}: run ./scripts/test once")
    return found


def generate(out: Path) -> None:
    """Generate *_pb2.py, *_pb2.pyi, *_pb2_grpc.py and *_pb2_grpc.pyi for every proto into `out`."""
    if not GEN_PYTHON.exists():
        raise SystemExit(f"{GEN_PYTHON} not found: ./scripts/test makes it (requirements/gen.txt)")
    plugins = [
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
    ]
    # The well-known types' .proto files ship inside grpc_tools.
    include = subprocess.run(
        [GEN_PYTHON, "-c", "import grpc_tools, os; print(os.path.dirname(grpc_tools.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for proto in PROTOS:
        result = subprocess.run(
            [
                GEN_PYTHON,
                "-m",
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"-I{include}/_proto",
                *plugins,
                f"--python_out={out}",
                f"--mypy_out={out}",
                f"--grpc_python_out={out}",
                f"--mypy_grpc_out={out}",
                proto,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise SystemExit(f"protoc failed for {proto}: {result.stderr.strip()}")


def differences(generated: Path) -> list[str]:
    """The committed generated files that differ from (or are missing in) `generated`."""
    made = {p.relative_to(generated) for p in generated.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(ROOT)
        for p in (ROOT / "devplugin_sdk" / "api").rglob("*_pb2*")
        if p.suffix in (".py", ".pyi")
    }
    return sorted(
        str(relative)
        for relative in made | committed
        if relative not in made
        or relative not in committed
        or (generated / relative).read_bytes() != (ROOT / relative).read_bytes()
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            stale = differences(Path(tmp))
        for name in stale:
            print(f"gen_proto: {name} differs from what the .proto files generate", file=sys.stderr)
        return 1 if stale else 0
    generate(Path(argv[0]) if argv else ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
