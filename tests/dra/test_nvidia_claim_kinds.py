"""Issue 37 items 1-6 and 8: NVIDIA's claim kinds (``resource.nvidia.com/v1beta1`` ``GpuConfig``
and ``MigDeviceConfig``) with NVIDIA's semantics, through DraNode with the NVIDIA backend serving
driver ``gpu.nvidia.com`` on fake NVML and a stand-in ``nvidia-smi`` (a real process) recording
its calls. Expectations are written from kubernetes-sigs/dra-driver-nvidia-gpu (commit 9593204):
each test cites the file and function. The MPS control daemon is not started (issue 37 item 7,
left for later): MPS claims get CUDA's client variables only."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from dra_helpers import calls, fake_nvidia_smi

from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.backends.nvidia.claim_config import (
    KINDS,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
)
from devplugin_sdk.dra import device_name
from devplugin_sdk.dra.config import ClaimConfigError, resolve
from devplugin_sdk.dra.resources import DeviceConfig, ResourceClaim
from devplugin_sdk.testing import DraNode, PodPreparationError, fake_nvml
from devplugin_sdk.testing.fake_nvml import FakeNVML

DRIVER = "gpu.nvidia.com"
NVIDIA = "resource.nvidia.com/v1beta1"

# demo/specs/quickstart/v1/gpu-test6.yaml, ResourceClaimTemplate "a100": spec.spec.devices.config
GPU_TEST6_CONFIG = """
- requests: ["gpu"]
  opaque:
    driver: gpu.nvidia.com
    parameters:
      apiVersion: resource.nvidia.com/v1beta1
      kind: GpuConfig
      sharing:
        strategy: TimeSlicing
        timeSlicingConfig:
          interval: Long
"""

# demo/specs/quickstart/v1/gpu-test5.yaml, ResourceClaimTemplate "multiple-gpus":
# spec.spec.devices.config
GPU_TEST5_CONFIG = """
- requests: ["ts-gpu"]
  opaque:
    driver: gpu.nvidia.com
    parameters:
      apiVersion: resource.nvidia.com/v1beta1
      kind: GpuConfig
      sharing:
        strategy: TimeSlicing
        timeSlicingConfig:
          interval: Long
- requests: ["mps-gpu"]
  opaque:
    driver: gpu.nvidia.com
    parameters:
      apiVersion: resource.nvidia.com/v1beta1
      kind: GpuConfig
      sharing:
        strategy: MPS
        mpsConfig:
          defaultActiveThreadPercentage: 50
          defaultPinnedDeviceMemoryLimit: 10Gi
"""


def claim_config(text: str) -> list[DeviceConfig]:
    """A claim template's ``config`` list as the scheduler copies it into the allocation."""
    return [
        DeviceConfig(
            "FromClaim", tuple(c["requests"]), c["opaque"]["driver"], c["opaque"]["parameters"]
        )
        for c in yaml.safe_load(text)
    ]


def gpu_config(
    kind: str = "GpuConfig", requests: tuple[str, ...] = (), **body: Any
) -> DeviceConfig:
    return DeviceConfig("FromClaim", requests, DRIVER, {"apiVersion": NVIDIA, "kind": kind, **body})


def time_slice(uuid: str, interval: int) -> list[str]:
    """NVIDIA's calls for one GPU (cmd/gpu-kubelet-plugin/sharing.go
    ``TimeSlicingManager.SetTimeSlice``: ``nvlib.go`` ``setComputeMode(uuids, "DEFAULT")``, then
    ``setTimeSlice(uuids, n)``; each runs ``nvidia-smi`` once per UUID)."""
    return [f"-i {uuid} -c DEFAULT", f"compute-policy -i {uuid} --set-timeslice {interval}"]


def env_of(node: DraNode, claim: ResourceClaim) -> dict[str, dict[str, str]]:
    """Each request's environment in a claim's CDI spec (its devices are ``<uid>-<request>``)."""
    return {
        d["name"].removeprefix(f"{claim.uid}-"): dict(
            e.split("=", 1) for e in d["containerEdits"]["env"]
        )
        for d in node.spec(claim).devices
    }


def _plugins(tmp_path: Path, nvml: FakeNVML, **changes: Any) -> list[NvmlPlugin]:
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root, **changes
    )
    command, _ = fake_nvidia_smi(tmp_path)
    plugins = list(NvmlPlugin.build(config, nvml=nvml))
    for plugin in plugins:
        plugin.nvidia_smi = command
    return plugins


# ----------------------------------------------------------------------------- time slicing


async def test_nvidias_time_slicing_template_gpu_test6_makes_nvidias_calls_and_resets(
    tmp_path: Path,
) -> None:
    """Prepare: device_state.go ``applySharingConfig`` -> ``SetTimeSlice`` (Long = 3,
    api/.../sharing.go ``TimeSliceInterval.Int``); unprepare: device_state.go
    ``unprepareDevices`` -> ``SetTimeSlice`` with ``DefaultTimeSlice`` (0)."""
    nvml = fake_nvml.dgx_a100()
    _, log = fake_nvidia_smi(tmp_path)
    gpu = nvml.gpus[0].uuid
    async with DraNode(*_plugins(tmp_path, nvml), driver=DRIVER) as node:
        pod = node.pod("a100", namespace="gpu-test6")
        node.claim(
            "a100",
            {"gpu": [device_name(gpu)]},
            pods=[pod],
            namespace="gpu-test6",
            config=claim_config(GPU_TEST6_CONFIG),
        )
        await node.prepare(pod)
        assert calls(log) == time_slice(gpu, 3)
        await node.unprepare(pod)
        assert calls(log) == time_slice(gpu, 0)


async def test_nvidias_template_gpu_test5_time_slicing_and_mps_prepared_unchanged(
    tmp_path: Path,
) -> None:
    """gpu-test5: ``ts-gpu`` gets NVIDIA's time-slice calls; ``mps-gpu`` gets CUDA's MPS client
    variables (NVIDIA starts a daemon instead: not built yet), and no ``nvidia-smi`` call."""
    nvml = fake_nvml.dgx_a100()
    _, log = fake_nvidia_smi(tmp_path)
    ts, mps = nvml.gpus[0].uuid, nvml.gpus[1].uuid
    async with DraNode(*_plugins(tmp_path, nvml), driver=DRIVER) as node:
        pod = node.pod("multiple-gpus", namespace="gpu-test5")
        claim = node.claim(
            "multiple-gpus",
            {"ts-gpu": [device_name(ts)], "mps-gpu": [device_name(mps)]},
            pods=[pod],
            namespace="gpu-test5",
            config=claim_config(GPU_TEST5_CONFIG),
        )
        await node.prepare(pod)
        assert calls(log) == time_slice(ts, 3)
        env = env_of(node, claim)
        assert env["mps-gpu"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["mps-gpu"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
        assert env["mps-gpu"]["NVIDIA_VISIBLE_DEVICES"] == mps
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env["ts-gpu"]
        await node.unprepare(pod)
        assert calls(log) == time_slice(ts, 0)


async def test_two_claims_on_one_gpu_reset_it_only_after_the_last(tmp_path: Path) -> None:
    """device_state.go ``unprepareDevices``: a GPU that another claim still uses
    (``isGpuUUIDInUseByOtherClaims``) keeps its time slice."""
    nvml = fake_nvml.t4_pcie()
    _, log = fake_nvidia_smi(tmp_path)
    gpu = nvml.gpus[0].uuid
    sliced = gpu_config(
        sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}
    )
    async with DraNode(*_plugins(tmp_path, nvml, replicas=2), driver=DRIVER) as node:
        await node.kubelet.wait_for(lambda: len(node.published()) == 4)
        first, second = node.pod("one", namespace="ml"), node.pod("two", namespace="ml")
        node.claim("one", [device_name(gpu)], pods=[first], namespace="ml", config=[sliced])
        node.claim("two", [device_name(gpu)], pods=[second], namespace="ml", config=[sliced])
        await node.prepare(first)
        await node.prepare(second)
        assert calls(log) == time_slice(gpu, 2) * 2
        await node.unprepare(first)
        assert calls(log) == []
        await node.unprepare(second)
        assert calls(log) == time_slice(gpu, 0)


# ----------------------------------------------------------------------------- defaults, ranges


async def test_no_sharing_does_nothing_and_a_sharing_without_strategy_is_refused(
    tmp_path: Path,
) -> None:
    """api/.../gpuconfig.go ``Normalize``/``Validate``: no ``sharing``, nothing to do;
    validate.go ``validateSharingStrategy``: an empty strategy is "unknown GPU sharing
    strategy"."""
    nvml = fake_nvml.dgx_a100()
    _, log = fake_nvidia_smi(tmp_path)
    names = [device_name(g.uuid) for g in nvml.gpus]
    async with DraNode(*_plugins(tmp_path, nvml), driver=DRIVER) as node:
        plain = node.pod("plain", namespace="ml")
        node.claim("plain", names[:1], pods=[plain], namespace="ml", config=[gpu_config()])
        await node.prepare(plain)
        await node.unprepare(plain)
        assert calls(log) == []
        bad = node.pod("bad", namespace="ml")
        node.claim("bad", names[1:2], pods=[bad], namespace="ml", config=[gpu_config(sharing={})])
        with pytest.raises(PodPreparationError) as failed:
            await node.prepare(bad)
        assert "opaque.parameters.sharing.strategy: unknown GPU sharing strategy" in str(
            failed.value
        )
        assert calls(log) == []


def _read(body: dict[str, Any], kind: str = "GpuConfig") -> Any:
    entry = DeviceConfig("FromClaim", ("r",), DRIVER, {"apiVersion": NVIDIA, "kind": kind, **body})
    claim = ResourceClaim("ns", "c", "uid", allocated=True, config=(entry,))
    return next(iter(resolve(claim, DRIVER, {"r": KINDS})["r"].values.values()))


def test_nvidias_ranges_and_fields() -> None:
    """validate.go ``MpsConfig.Validate``: 0-100; sharing.go ``limit.Megabyte``: a limit under
    1 MiB is "value set too low"; sharing.go ``MpsConfig.MultiUser`` is a field."""
    mps = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0, "multiUser": True}}
    assert _read({"sharing": mps}) == GpuConfig("MPS", mps=MpsConfig(0, multi_user=True))
    assert _read({}) == GpuConfig()
    for body, said in (
        ({"defaultActiveThreadPercentage": 101}, "must be <= 100"),
        ({"defaultActiveThreadPercentage": -1}, "must be >= 0"),
        ({"defaultPinnedDeviceMemoryLimit": "512Ki"}, "value set too low"),
        ({"defaultPerDevicePinnedMemoryLimit": {"0": "1000Ki"}}, "value set too low"),
    ):
        with pytest.raises(ClaimConfigError, match=said):
            _read({"sharing": {"strategy": "MPS", "mpsConfig": body}})
    with pytest.raises(
        ClaimConfigError, match="mpsConfig: cannot be used with strategy TimeSlicing"
    ):
        _read({"sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}})
    assert _read({"sharing": {"strategy": "MPS"}}) == GpuConfig("MPS")
    with pytest.raises(ClaimConfigError, match="unknown GPU sharing strategy: 'Long'"):
        _read({"sharing": {"strategy": "Long"}}, "MigDeviceConfig")
    assert _read({"sharing": {"strategy": "TimeSlicing"}}, "MigDeviceConfig") == MigDeviceConfig(
        "TimeSlicing"
    )


async def test_per_device_limit_keys_are_positions_in_the_sorted_uuid_list(tmp_path: Path) -> None:
    """sharing.go ``MpsPerDevicePinnedMemoryLimit.Normalize``/``uuidSet.Normalize``: a key is a
    UUID of the claim's devices or a position in their sorted UUID list (``UUIDs()``,
    allocatable.go, sorts). Limits that differ by device are refused: CUDA's client variable keys
    devices by CUDA's order, which only NVIDIA's daemon (by UUID) avoids."""
    nvml = fake_nvml.dgx_a100()
    _, log = fake_nvidia_smi(tmp_path)
    # Two GPUs whose node order is not their UUID order: position 1 is the lower index.
    pair = next(
        [a, b] for a in nvml.gpus for b in nvml.gpus if a.index < b.index and a.uuid > b.uuid
    )
    first, last = sorted(g.uuid for g in pair)

    def mps(**limits: Any) -> DeviceConfig:
        return gpu_config(sharing={"strategy": "MPS", "mpsConfig": limits})

    async with DraNode(*_plugins(tmp_path, nvml), driver=DRIVER) as node:
        names = [device_name(g.uuid) for g in pair]
        outcomes: dict[str, str] = {}
        for case, config in {
            "same": mps(defaultPerDevicePinnedMemoryLimit={"0": "4Gi", last: "4Gi"}),
            "differ": mps(
                defaultPinnedDeviceMemoryLimit="8Gi", defaultPerDevicePinnedMemoryLimit={"1": "4Gi"}
            ),
            "beyond": mps(defaultPerDevicePinnedMemoryLimit={"2": "4Gi"}),
        }.items():
            pod = node.pod(case, namespace="ml")
            claim = node.claim(case, {"gpus": names}, pods=[pod], namespace="ml", config=[config])
            try:
                await node.prepare(pod)
            except PodPreparationError as exc:
                outcomes[case] = str(exc)
            else:
                outcomes[case] = env_of(node, claim)["gpus"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
                await node.unprepare(pod)
            node.api.delete_claim("ml", case)
    assert outcomes["same"] == "0=4096M,1=4096M"
    # Position 1 is the second UUID in sorted order, whatever the GPUs' node indexes.
    assert f"({first}=8192M, {last}=4096M) need the MPS control daemon" in outcomes["differ"]
    assert "defaultPerDevicePinnedMemoryLimit.2: invalid device" in outcomes["beyond"]
    assert calls(log) == []


# ----------------------------------------------------------------------------- MIG


async def test_mig_device_config_is_for_mig_devices_and_gpu_config_for_full_gpus(
    tmp_path: Path,
) -> None:
    """device_state.go ``getConfigResultsMap``: an entry naming a request whose device is of
    another type fails (``validateDeviceConfigType``: "cannot apply GpuConfig to device"); one
    naming no request is skipped for it (``matchesDeviceType``). sharing.go
    ``MigDeviceSharing.GetTimeSlicingConfig`` returns nothing: TimeSlicing on MIG does nothing."""
    nvml = fake_nvml.a100_mig([("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), None])
    _, log = fake_nvidia_smi(tmp_path)
    mig_gpu, plain = nvml.gpus
    mig = device_name(mig_gpu.migs[0].uuid)
    sliced = {"sharing": {"strategy": "TimeSlicing"}}
    mps = {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}}
    async with DraNode(*_plugins(tmp_path, nvml, mig_strategy="mixed"), driver=DRIVER) as node:
        await node.kubelet.wait_for(lambda: len(node.published()) == 6)
        outcomes: dict[str, str | dict[str, str]] = {}
        for case, device, config in (
            ("mig-ts", mig, gpu_config("MigDeviceConfig", ("r",), **sliced)),
            ("mig-mps", mig, gpu_config("MigDeviceConfig", ("r",), **mps)),
            ("mig-general-gpu", mig, gpu_config("GpuConfig", (), **sliced)),
            ("mig-named-gpu", mig, gpu_config("GpuConfig", ("r",), **sliced)),
            (
                "gpu-named-mig",
                device_name(plain.uuid),
                gpu_config("MigDeviceConfig", ("r",), **mps),
            ),
        ):
            pod = node.pod(case, namespace="ml")
            claim = node.claim(case, {"r": [device]}, pods=[pod], namespace="ml", config=[config])
            try:
                await node.prepare(pod)
            except PodPreparationError as exc:
                outcomes[case] = str(exc)
            else:
                outcomes[case] = env_of(node, claim)["r"]
                await node.unprepare(pod)
            node.api.delete_claim("ml", case)
            outcomes[case + " calls"] = " ".join(calls(log))
    assert isinstance(outcomes["mig-ts"], dict)
    mig_env = outcomes["mig-mps"]
    assert isinstance(mig_env, dict)
    assert mig_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert mig_env["NVIDIA_VISIBLE_DEVICES"] == mig_gpu.migs[0].uuid
    assert isinstance(outcomes["mig-general-gpu"], dict)
    assert (
        f"cannot apply GpuConfig to device {mig_gpu.migs[0].uuid} of type mig (request: r)"
        in str(outcomes["mig-named-gpu"])
    )
    assert f"cannot apply MigDeviceConfig to device {plain.uuid} of type gpu" in str(
        outcomes["gpu-named-mig"]
    )
    assert all(v == "" for k, v in outcomes.items() if k.endswith(" calls"))


async def test_a_failed_reset_is_logged_and_the_claim_is_unprepared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unlike NVIDIA's driver (device_state.go ``unprepareDevices`` returns the error and the
    kubelet retries), the record is already gone: the failure is logged, the claim unprepared."""
    nvml = fake_nvml.dgx_a100()
    plugins = _plugins(tmp_path, nvml)
    gpu = nvml.gpus[0].uuid
    async with DraNode(*plugins, driver=DRIVER) as node:
        pod = node.pod("a100", namespace="gpu-test6")
        claim = node.claim(
            "a100",
            {"gpu": [device_name(gpu)]},
            pods=[pod],
            namespace="gpu-test6",
            config=claim_config(GPU_TEST6_CONFIG),
        )
        await node.prepare(pod)
        for plugin in plugins:
            plugin.nvidia_smi = (sys.executable, "-c", "import sys; sys.exit(4)")
        await node.unprepare(pod)
        assert not node.spec_path(claim).exists()
    (line,) = [r.getMessage() for r in caplog.records if "release_configured" in r.getMessage()]
    assert "claim gpu-test6/a100: nvidia.com/gpu: release_configured() failed" in line
    assert "failed with exit code 4" in line
