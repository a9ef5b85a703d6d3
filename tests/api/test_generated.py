"""The committed generated code is exactly what the pinned generators make from the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "devplugin_sdk" / "api"


def _load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regeneration_reproduces_committed_files(tmp_path: Path) -> None:
    """scripts/gen_proto.py (protoc 25.1 from .venv-gen, the stubs' plugin from this venv) gives
    byte-identical files to the committed ones, and names none as differing."""
    generator = _load_generator()
    generator.generate(tmp_path)
    # differences(): every file in either set, compared byte for byte (its own test below shows
    # it names an edited, a missing and an extra file).
    assert generator.differences(tmp_path) == []
    assert len(list(tmp_path.rglob("*_pb2*"))) == 24  # 6 protos x (_pb2, _pb2_grpc) x (.py, .pyi)


def test_check_names_a_committed_file_that_differs(tmp_path: Path) -> None:
    """The comparison behind --check finds an edited, a missing and an extra file."""
    generator = _load_generator()
    committed = sorted(p for p in API.rglob("*_pb2*") if p.suffix in (".py", ".pyi"))
    for path in committed:
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    assert generator.differences(tmp_path) == []
    edited, missing = committed[0], committed[1]
    (tmp_path / edited.relative_to(ROOT)).write_bytes(edited.read_bytes() + b"# edited\n")
    (tmp_path / missing.relative_to(ROOT)).unlink()
    (tmp_path / "devplugin_sdk" / "api" / "extra_pb2.py").write_text("")
    assert generator.differences(tmp_path) == sorted(
        [
            str(edited.relative_to(ROOT)),
            str(missing.relative_to(ROOT)),
            "devplugin_sdk/api/extra_pb2.py",
        ]
    )


def test_generated_code_checks_no_runtime_version_at_import() -> None:
    """Code from protoc 25 / grpcio-tools 1.62 loads on every protobuf and grpcio the package
    declares: no runtime-version check that would refuse an older (or a much newer) runtime."""
    for path in API.rglob("*_pb2*.py"):
        text = path.read_text()
        assert "ValidateProtobufRuntimeVersion" not in text, path
        assert "GRPC_GENERATED_VERSION" not in text, path


def test_method_paths_keep_the_kubelet_package() -> None:
    """Method paths start with /v1beta1. and /pluginregistration. as the kubelet dials them."""
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
    from devplugin_sdk.api.pluginregistration.v1 import pluginregistration_pb2 as preg

    services = {
        s.full_name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()
    }
    assert services == {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
    assert [s.full_name for s in preg.DESCRIPTOR.services_by_name.values()] == [
        "pluginregistration.Registration"
    ]


def test_both_protos_load_in_one_process() -> None:
    """Unique file paths: both APIs share one descriptor pool (upstream names both api.proto)."""
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
    from devplugin_sdk.api.pluginregistration.v1 import pluginregistration_pb2 as preg

    assert pb.DESCRIPTOR.name != preg.DESCRIPTOR.name
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert preg.DESCRIPTOR.package == "pluginregistration"


def test_wire_field_numbers_match_the_kubelet() -> None:
    """Field names and numbers are the kubelet's (the wire contract)."""
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb

    fields = {
        m.name: {f.name: f.number for f in m.fields}
        for m in pb.DESCRIPTOR.message_types_by_name.values()
    }
    assert fields["Device"] == {"ID": 1, "health": 2, "topology": 3}
    assert fields["RegisterRequest"] == {
        "version": 1,
        "endpoint": 2,
        "resource_name": 3,
        "options": 4,
    }
    assert fields["ContainerAllocateResponse"] == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert fields["ContainerPreferredAllocationRequest"] == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert fields["PreStartContainerRequest"] == {"devices_ids": 1}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_dra_method_paths_and_fields_are_the_kubelets(version: str) -> None:
    """The kubelet calls /k8s.io.kubelet.pkg.apis.dra.<version>.DRAPlugin/...; the fields are
    its wire contract (k8s.io/kubelet pkg/apis/dra/<version>/api.proto)."""
    dra = importlib.import_module(f"devplugin_sdk.api.dra.{version}.dra_pb2")
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    assert dra.DESCRIPTOR.package == package
    services = {
        s.full_name: [m.name for m in s.methods] for s in dra.DESCRIPTOR.services_by_name.values()
    }
    assert services == {f"{package}.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"]}
    fields = {
        m.name: {f.name: f.number for f in m.fields}
        for m in dra.DESCRIPTOR.message_types_by_name.values()
    }
    assert fields["Claim"] == {"namespace": 1, "uid": 2, "name": 3}
    assert fields["Device"] == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        # v1 only: the shareID of a device allocated to several claims (KEP-5075).
        **({"share_id": 5} if version == "v1" else {}),
    }
    assert fields["NodePrepareResourceResponse"] == {"devices": 1, "error": 2}
    assert fields["NodeUnprepareResourceResponse"] == {"error": 1}
    assert fields["NodePrepareResourcesResponse"] == {"claims": 1}


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_dra_health_service_names_and_fields_are_the_kubelets(version: str) -> None:
    """The plugin lists <version>.DRAResourceHealth in GetInfo and the kubelet calls
    /<version>.DRAResourceHealth/NodeWatchResources; the fields are its wire contract
    (k8s.io/kubelet pkg/apis/dra-health/<version>/api.proto)."""
    health = importlib.import_module(f"devplugin_sdk.api.dra_health.{version}.dra_health_pb2")
    assert health.DESCRIPTOR.package == version
    services = {
        s.full_name: [(m.name, m.server_streaming) for m in s.methods]
        for s in health.DESCRIPTOR.services_by_name.values()
    }
    assert services == {f"{version}.DRAResourceHealth": [("NodeWatchResources", True)]}
    fields = {
        m.name: {f.name: f.number for f in m.fields}
        for m in health.DESCRIPTOR.message_types_by_name.values()
    }
    assert fields["DeviceIdentifier"] == {"pool_name": 1, "device_name": 2}
    assert fields["DeviceHealth"] == {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    }
    assert fields["NodeWatchResourcesResponse"] == {"devices": 1}
    statuses = health.DESCRIPTOR.enum_types_by_name["HealthStatus"].values_by_name
    assert {name: v.number for name, v in statuses.items()} == {
        "UNKNOWN": 0,
        "HEALTHY": 1,
        "UNHEALTHY": 2,
    }


def test_every_api_loads_in_one_process() -> None:
    """Both DRA versions, both health versions, the device-plugin API and the registration API
    share one pool."""
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
    from devplugin_sdk.api.dra.v1 import dra_pb2 as v1
    from devplugin_sdk.api.dra.v1beta1 import dra_pb2 as v1beta1
    from devplugin_sdk.api.dra_health.v1 import dra_health_pb2 as h1
    from devplugin_sdk.api.dra_health.v1alpha1 import dra_health_pb2 as h1alpha1
    from devplugin_sdk.api.pluginregistration.v1 import pluginregistration_pb2 as preg

    names = {m.DESCRIPTOR.name for m in (pb, v1, v1beta1, h1, h1alpha1, preg)}
    assert len(names) == 6


def test_importing_the_sdk_does_not_import_nvml() -> None:
    """Optional heavy dependencies stay in their backend."""
    import subprocess

    code = (
        "import devplugin_sdk, devplugin_sdk.backends, devplugin_sdk.testing, sys;"
        "print('pynvml' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
