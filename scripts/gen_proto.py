"""Regenerate the committed protobuf/gRPC code under devplugin_sdk/api from its .proto files.

Usage: python scripts/gen_proto.py [OUTPUT_ROOT]

The include root is the repository root, so generated imports are package-absolute
(`from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2`). Pinned generators
(grpcio-tools and mypy-protobuf, see pyproject's `dev` extra) make the output reproducible;
tests/api/test_generated.py regenerates into a temporary directory and compares byte for byte.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = (
    "devplugin_sdk/api/deviceplugin/v1beta1/deviceplugin.proto",
    "devplugin_sdk/api/pluginregistration/v1/pluginregistration.proto",
    "devplugin_sdk/api/dra/v1/dra.proto",
    "devplugin_sdk/api/dra/v1beta1/dra.proto",
)


def _plugin(name: str) -> str:
    """Absolute path of a protoc plugin installed beside this Python (e.g. in the venv)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: pip install -e '.[dev]' (it comes with mypy-protobuf)")
    return found


def generate(out: Path) -> None:
    """Generate *_pb2.py, *_pb2.pyi, *_pb2_grpc.py and *_pb2_grpc.pyi for every proto into `out`."""
    include = str(Path(protoc.__file__).parent / "_proto")
    plugins = [
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
    ]
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{include}",
            *plugins,
            f"--python_out={out}",
            f"--mypy_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_grpc_out={out}",
            proto,
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
