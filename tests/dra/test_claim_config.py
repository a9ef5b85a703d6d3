"""Typed opaque claim configuration (issue 28 item 3): a DeviceClass's config and a claim's
override are applied per request; a bad parameter fails that claim only, naming the claim, the
request and the key. The NVIDIA backend's ``GpuConfig`` on fake NVML, through FakeKubelet's DRA
side over real gRPC, and the claim's ``config`` entries read by the real Kubernetes client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dra_helpers import fake_nvidia_smi
from kube_apiserver import FakeApiServer

from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.config import ConfigReader
from devplugin_sdk.dra import device_name, kube_api
from devplugin_sdk.dra.config import ClaimConfigError, ConfigKind, resolve
from devplugin_sdk.dra.resources import DeviceConfig, ResourceClaim
from devplugin_sdk.testing import ClaimSpec, DraNode, MemoryApi, PodPreparationError, fake_nvml

GPU_DRIVER = "gpu.devplugin.example.com"
API_VERSION = f"{GPU_DRIVER}/v1alpha1"


def gpu_config(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": sharing}


def mps(**limits: Any) -> dict[str, Any]:
    return gpu_config(strategy="MPS", mpsConfig=limits)


def env_of(spec: ClaimSpec) -> dict[str, dict[str, str]]:
    """Each CDI device's (request's) environment in a claim's spec."""
    return {
        d["name"].rsplit("-", 1)[1]: dict(e.split("=", 1) for e in d["containerEdits"]["env"])
        for d in spec.devices
    }


async def test_class_config_and_claim_override_apply_per_request_and_a_bad_one_fails_its_claim(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root
    )
    api = MemoryApi(nodes=["node-1"])
    names = [device_name(g.uuid) for g in nvml.gpus]
    async with DraNode(NvmlPlugin(config, nvml=nvml), driver=GPU_DRIVER, memory=api) as node:
        pod = node.pod("shared", "broken", name="trainer", namespace="ml")
        assert len(api.pool(GPU_DRIVER, "node-1")) == 1
        # The class gives both requests MPS at 50 % with 10 GiB pinned; the claim overrides
        # request "b" with 25 % (the claim's entry replaces the class's for that request).
        api.allocate(
            "ml",
            "shared",
            {"a": [names[0]], "b": [names[1]]},
            driver=GPU_DRIVER,
            pool="node-1",
            pods=[pod.uid],
            config=[
                DeviceConfig(
                    "FromClaim", ("b",), GPU_DRIVER, mps(defaultActiveThreadPercentage=25)
                ),
                DeviceConfig(
                    "FromClass",
                    ("a", "b"),
                    GPU_DRIVER,
                    mps(
                        defaultActiveThreadPercentage=50,
                        defaultPinnedDeviceMemoryLimit="10Gi",
                    ),
                ),
                # Another driver's entry is left to it.
                DeviceConfig("FromClaim", (), "nic.example.com", {"anything": True}),
            ],
        )
        api.allocate(
            "ml",
            "broken",
            {"gpus": [names[2]]},
            driver=GPU_DRIVER,
            pool="node-1",
            pods=[pod.uid],
            config=[
                DeviceConfig(
                    "FromClaim", ("gpus",), GPU_DRIVER, mps(defaultActiveThreadPercentage=150)
                )
            ],
        )
        with pytest.raises(PodPreparationError) as failed:
            await node.prepare(pod)
        message = str(failed.value)
        assert "ml/broken" in message
        assert "request gpus" in message
        assert "opaque.parameters.sharing.mpsConfig.defaultActiveThreadPercentage" in message
        assert "must be <= 100, got 150" in message
        # The other claim of the same call was prepared, each request with its own config.
        shared = api.claims[("ml", "shared")]
        env = env_of(node.spec(shared))
        assert env["a"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["a"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
        assert env["b"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env["b"]
        assert env["a"]["NVIDIA_VISIBLE_DEVICES"] == nvml.gpus[0].uuid
        broken = api.claims[("ml", "broken")]
        assert not node.spec_path(broken).exists()


async def test_time_slicing_sets_the_gpus_time_slice_at_prepare(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root
    )
    command, log = fake_nvidia_smi(tmp_path)
    plugin = NvmlPlugin(config, nvml=nvml)
    plugin.nvidia_smi = command
    api = MemoryApi(nodes=["node-1"])
    names = [device_name(g.uuid) for g in nvml.gpus]
    async with DraNode(plugin, driver=GPU_DRIVER, memory=api) as node:
        pod = node.pod("two", name="sliced", namespace="ml")
        assert len(api.pool(GPU_DRIVER, "node-1")) == 1
        api.allocate(
            "ml",
            "two",
            {"gpus": names[:2]},
            driver=GPU_DRIVER,
            pool="node-1",
            pods=[pod.uid],
            config=[
                DeviceConfig(
                    "FromClass",
                    ("gpus",),
                    GPU_DRIVER,
                    gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}),
                )
            ],
        )
        await node.prepare(pod)
    # NVIDIA's driver (cmd/gpu-kubelet-plugin/sharing.go SetTimeSlice, nvlib.go setComputeMode
    # and setTimeSlice): compute mode DEFAULT on each GPU, then the slice on each, by UUID.
    uuids = sorted(g.uuid for g in nvml.gpus[:2])
    assert log.read_text().splitlines() == [
        *(f"-i {u} -c DEFAULT" for u in uuids),
        *(f"compute-policy -i {u} --set-timeslice 3" for u in uuids),
    ]


# ----------------------------------------------------------------------------- resolve


def _read(reader: ConfigReader) -> dict[str, Any]:
    return {"size": reader.integer("size", 1, minimum=1)}


WIDGET = ConfigKind("WidgetConfig", "v1", _read)


def claim(*config: DeviceConfig) -> ResourceClaim:
    return ResourceClaim("ns", "c", "uid", allocated=True, config=config)


def entry(source: str, requests: tuple[str, ...], **params: Any) -> DeviceConfig:
    parameters = {"apiVersion": "w.example.com/v1", "kind": "WidgetConfig", **params}
    return DeviceConfig(source, requests, "w.example.com", parameters)  # type: ignore[arg-type]


def test_a_main_request_covers_its_subrequests_and_the_claim_wins_over_the_class() -> None:
    resolved = resolve(
        claim(entry("FromClaim", ("big",), size=8), entry("FromClass", (), size=2)),
        "w.example.com",
        {"big/large": [WIDGET], "small": [WIDGET]},
    )
    assert resolved["big/large"].get(WIDGET) == {"size": 8}
    assert resolved["big/large"].sources["WidgetConfig"] == "claim config[0]"
    assert resolved["small"].get(WIDGET) == {"size": 2}


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ("not an object", "opaque.parameters: must be an object with apiVersion and kind"),
        ({"kind": "WidgetConfig"}, "opaque.parameters.apiVersion: is required"),
        (
            {"apiVersion": "w.example.com/v2", "kind": "WidgetConfig"},
            "opaque.parameters.kind: 'w.example.com/v2' 'WidgetConfig' is not a kind this "
            "driver reads (it reads w.example.com/v1 WidgetConfig)",
        ),
        (
            {"apiVersion": "w.example.com/v1", "kind": "WidgetConfig", "sise": 3},
            "opaque.parameters.sise: unknown key",
        ),
        (
            {"apiVersion": "w.example.com/v1", "kind": "WidgetConfig", "size": 0},
            "opaque.parameters.size: must be >= 1, got 0",
        ),
    ],
)
def test_a_bad_entry_names_the_claim_the_request_and_the_key(
    parameters: Any, expected: str
) -> None:
    bad = DeviceConfig("FromClaim", ("r",), "w.example.com", parameters)
    with pytest.raises(ClaimConfigError) as raised:
        resolve(claim(bad), "w.example.com", {"r": [WIDGET]})
    assert str(raised.value).startswith(f"claim ns/c, request r: claim config[0] {expected}")


def test_a_driver_without_kinds_refuses_configuration_rather_than_ignoring_it() -> None:
    with pytest.raises(ClaimConfigError, match="it reads no configuration"):
        resolve(claim(entry("FromClass", ())), "w.example.com", {"r": []})


async def test_the_real_client_reads_the_allocation_config(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=["node-1"])
    memory.add_claim("ns", "c")
    memory.claims[("ns", "c")] = claim_with = ResourceClaim(
        "ns",
        "c",
        memory.claims[("ns", "c")].uid,
        allocated=True,
        config=(
            entry("FromClass", ("r",), size=2),
            DeviceConfig("FromClaim", (), "other.example.com", {"x": [1, {"y": None}]}),
        ),
    )
    async with FakeApiServer(memory).serving() as server:
        api = kube_api(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            read = await api.read_claim("ns", "c")
        finally:
            await api.aclose()
    assert read.config == claim_with.config
