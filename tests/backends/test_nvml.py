"""The NVML backend on fake machines: discovery, MIG, sharing, container setup, config, placement."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devplugin_sdk.backends.nvidia import (
    NvidiaConfig,
    NvmlPlugin,
    from_config,
    mig_profile_name,
    pci_address,
)
from devplugin_sdk.errors import (
    AllocationError,
    BackendError,
    ConfigError,
    MissingDependencyError,
)
from devplugin_sdk.testing import fake_nvml
from devplugin_sdk.testing.fake_nvml import FakeGPU, FakeNVML
from devplugin_sdk.types import Device, Health, Mount

# Every key of the backend at any level, for generated configurations.
_KEYS = [
    "version",
    "resourceName",
    "migStrategy",
    "deviceListStrategy",
    "cdiKind",
    "passDeviceSpecs",
    "sharing",
    "timeSlicing",
    "replicas",
    "renameByDefault",
    "failRequestsGreaterThanOne",
    "health",
    "disabled",
    "ignoredXids",
    "probeInterval",
    "recoveryPeriod",
    "sysfsRoot",
    "devRoot",
    "procRoot",
    "mps",
    "memory",
    "unit",
    "placement",
    "countResourceName",
    "multiGpu",
    "interceptor",
    "hostPath",
    "vgpu",
    "slices",
    "memoryLimit",
    "coreLimit",
]

CONTROL = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]


def plugin_for(nvml: FakeNVML, tmp_path: Path, **config: Any) -> NvmlPlugin:
    roots = nvml.write_host(tmp_path)
    cfg = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root, **config
    )
    return NvmlPlugin(cfg, nvml=nvml)


def plugins_for(nvml: FakeNVML, tmp_path: Path, config: dict[str, Any]) -> list[NvmlPlugin]:
    """``from_config`` as ``devplugin run nvidia`` calls it, on the fake machine ``nvml``."""
    roots = nvml.write_host(tmp_path)
    with nvml.installed():
        plugins = from_config({**config, **roots.config()})
    assert all(isinstance(p, NvmlPlugin) for p in plugins)
    return [p for p in plugins if isinstance(p, NvmlPlugin)]


def by_index(devices: Sequence[Device]) -> dict[int, Device]:
    return {int(d.attributes["index"]): d for d in devices}


# ----------------------------------------------------------------------------- discovery


async def test_gpus_carry_the_facts_dra_publishes(tmp_path: Path) -> None:
    """Typed attributes a scheduler can select on: versions, architecture, topology."""
    from devplugin_sdk.types import Quantity, Version

    h100 = (await plugin_for(fake_nvml.hgx_h100(), tmp_path / "h100").discover())[0]
    assert h100.attributes["type"] == "gpu"
    assert h100.attributes["index"] == 0
    assert h100.attributes["architecture"] == "Hopper"
    assert h100.attributes["cudaComputeCapability"] == Version("9.0.0")
    assert h100.attributes["driverVersion"] == Version("570.124.6")
    assert h100.attributes["cudaDriverVersion"] == Version("12.8.0")
    assert h100.attributes["numaNode"] == 0
    assert h100.attributes["resource.kubernetes.io/pciBusID"] == "0000:18:00.0"
    assert h100.attributes["resource.kubernetes.io/pcieRoot"] == "pci0000:00"
    assert h100.attributes["fabricCliqueID"] == 1
    assert h100.attributes["nvlinkDomain"] == f"{h100.attributes['fabricClusterUUID']}.1"
    assert h100.capacity == {"memory": Quantity(81559 * 2**20)}

    dgx = await plugin_for(fake_nvml.dgx_a100(), tmp_path / "dgx").discover()
    # No fabric manager domain: the GPUs on the same NVSwitches form one NVLink domain.
    assert {d.attributes["nvlinkDomain"] for d in dgx} == {"nvlink-0000:07:00.0"}
    assert "fabricClusterUUID" not in dgx[0].attributes
    # Pairs share a PCIe root complex.
    roots = [d.attributes["resource.kubernetes.io/pcieRoot"] for d in dgx]
    assert roots[0] == roots[1] != roots[2] == roots[3]

    t4 = await plugin_for(fake_nvml.t4_pcie(), tmp_path / "t4").discover()
    assert t4[0].attributes["architecture"] == "Turing"
    assert "nvlinkDomain" not in t4[0].attributes  # PCIe only


async def test_mig_devices_carry_their_parents_facts(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb", "1g.10gb")])
    plugin = plugin_for(nvml, tmp_path, mig_strategy="single")
    devices = await plugin.discover()
    assert {d.attributes["type"] for d in devices} == {"mig"}
    assert [(d.attributes["gi"], d.attributes["ci"]) for d in devices] == [(1, 0), (2, 0)]
    assert {str(d.capacity["memory"]) for d in devices} == {"9728Mi"}
    assert {d.attributes["architecture"] for d in devices} == {"Ampere"}


async def test_facts_an_older_nvml_lacks_are_left_out(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.fail("nvmlDeviceGetArchitecture", nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    nvml.fail("nvmlSystemGetCudaDriverVersion", nvml.NVML_ERROR_NOT_SUPPORTED)
    [first, *_] = await plugin_for(nvml, tmp_path).discover()
    assert "architecture" not in first.attributes
    assert "cudaDriverVersion" not in first.attributes
    assert first.attributes["driverVersion"]


async def test_discovers_every_dgx_a100_gpu_with_uuid_numa_node_and_device_nodes(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)

    devices = await plugin.discover()

    assert plugin.resource_name == "nvidia.com/gpu"
    assert [d.id for d in devices] == [g.uuid for g in nvml.gpus]
    assert [d.numa_nodes for d in devices] == [(3,), (3,), (1,), (1,), (7,), (7,), (5,), (5,)]
    assert [n.host_path for n in devices[5].device_nodes] == ["/dev/nvidia5", *CONTROL]
    assert devices[5].attributes["name"] == "NVIDIA A100-SXM4-80GB"
    assert devices[5].attributes["memoryMiB"] == 81920
    assert devices[5].attributes["pciBusID"] == "00000000:90:00.0"
    assert all(d.health is Health.HEALTHY and d.parent is None for d in devices)


async def test_control_nodes_missing_from_dev_are_left_out(tmp_path: Path) -> None:
    plugin = plugin_for(fake_nvml.t4_pcie(), tmp_path)
    (tmp_path / "dev" / "nvidia-modeset").unlink()
    (tmp_path / "dev" / "nvidia-uvm-tools").unlink()

    devices = await plugin.discover()

    assert [n.host_path for n in devices[0].device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]


async def test_numa_node_minus_one_in_sysfs_means_no_numa_affinity(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.gpus[2].numa_node = None  # the fake writes -1, as the kernel does
    plugin = plugin_for(nvml, tmp_path)

    devices = await plugin.discover()

    assert [d.numa_nodes for d in devices] == [(0,), (0,), (), (1,)]


def test_nvml_bus_ids_map_to_sysfs_addresses() -> None:
    assert pci_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert pci_address("00010000:07:00.1") == "10000:07:00.1"
    with pytest.raises(ValueError, match="malformed"):
        pci_address("3b.0")


async def test_a_gpu_lost_before_the_first_scan_is_skipped_and_the_others_served(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.lose(2)
    plugin = plugin_for(nvml, tmp_path)

    devices = await plugin.discover()

    assert sorted(by_index(devices)) == [0, 1, 3]


async def test_a_gpu_lost_after_discovery_stays_listed_as_unhealthy_on_rescan(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()
    nvml.lose(1)

    devices = by_index(await plugin.discover())

    assert sorted(devices) == [0, 1, 2, 3]
    assert devices[1].health is Health.UNHEALTHY
    assert {devices[i].health for i in (0, 2, 3)} == {Health.HEALTHY}


async def test_missing_nvml_library_says_what_to_install(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.fail("nvmlInit", fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    plugin = plugin_for(nvml, tmp_path)

    with pytest.raises(BackendError, match=r"libnvidia-ml\.so\.1 was not found"):
        await plugin.discover()


def test_real_pynvml_without_a_driver_gives_the_same_clear_error(tmp_path: Path) -> None:
    import ctypes.util

    import pynvml

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVIDIA driver")
    plugin = NvmlPlugin(NvidiaConfig(sysfs_root=tmp_path, dev_root=tmp_path), nvml=pynvml)

    # pynvml's own description of the failure sits between ours, in its words.
    with pytest.raises(
        BackendError,
        match=r"^NVML initialisation failed: .+ \(libnvidia-ml\.so\.1 was not found: install the NVIDIA",
    ):
        plugin.scan()


def test_missing_nvidia_ml_py_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail

    with pytest.raises(MissingDependencyError, match=r"devplugin-sdk\[nvidia\]"):
        from_config({})


def test_importing_the_backend_does_not_import_pynvml() -> None:
    code = "import sys, devplugin_sdk.backends.nvidia as m; m.from_config; print('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- MIG


def test_mig_profile_names_follow_nvidias_rounding() -> None:
    gib = 2**30
    assert mig_profile_name(1, 1, 9728, 80 * gib) == "1g.10gb"
    assert mig_profile_name(7, 7, 80896, 80 * gib) == "7g.80gb"
    assert mig_profile_name(2, 1, 19968, 80 * gib) == "1c.2g.20gb"
    assert mig_profile_name(1, 1, 4864, 40 * gib) == "1g.5gb"  # A100 40GB
    assert mig_profile_name(1, 1, 9856, 81559 * 2**20) == "1g.10gb"  # H100 80GB


async def test_mixed_strategy_serves_one_resource_per_mig_profile(tmp_path: Path) -> None:
    layout = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    nvml = fake_nvml.a100_mig([layout, None])

    plugins = plugins_for(nvml, tmp_path, {"migStrategy": "mixed"})
    found = {p.resource_name: await p.discover() for p in plugins}

    assert sorted(found) == [
        "nvidia.com/gpu",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-2g.20gb",
        "nvidia.com/mig-3g.40gb",
    ]
    assert [d.id for d in found["nvidia.com/gpu"]] == [nvml.gpus[1].uuid]
    assert [d.id for d in found["nvidia.com/mig-1g.10gb"]] == [
        m.uuid for m in nvml.gpus[0].migs[2:]
    ]
    assert all(d.parent == nvml.gpus[0].uuid for d in found["nvidia.com/mig-1g.10gb"])


async def test_mig_devices_get_the_parent_gpu_node_and_their_capability_nodes(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb", "1g.10gb")])
    [_, plugin] = plugins_for(nvml, tmp_path, {"migStrategy": "mixed"})

    devices = await plugin.discover()

    # mig-minors: gpu0/gi<g>/access is 3 + 9g, its ci0/access the next minor.
    second = nvml.gpus[0].migs[1]
    assert second.gi == 2
    assert [n.host_path for n in devices[1].device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia-caps/nvidia-cap22",
        *CONTROL,
    ]
    for node in devices[1].device_nodes:
        assert (tmp_path / node.host_path.lstrip("/")).exists()


async def test_single_strategy_serves_mig_devices_as_gpus(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 7, ("1g.10gb",) * 7])
    [plugin] = plugins_for(nvml, tmp_path, {"migStrategy": "single"})

    devices = await plugin.discover()

    assert plugin.resource_name == "nvidia.com/gpu"
    assert len(devices) == 14
    assert {d.attributes["migProfile"] for d in devices} == {"1g.10gb"}


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        ([("1g.10gb",), ("2g.20gb",)], "one MIG profile on every GPU"),
        ([("1g.10gb",), None], r"GPUs \[1\] have MIG disabled"),
    ],
)
async def test_single_strategy_refuses_layouts_it_cannot_name_as_one_resource(
    tmp_path: Path, layouts: list[tuple[str, ...] | None], message: str
) -> None:
    [plugin] = plugins_for(fake_nvml.a100_mig(layouts), tmp_path, {"migStrategy": "single"})

    with pytest.raises(BackendError, match=message):
        await plugin.discover()


async def test_none_strategy_serves_full_gpus_even_with_mig_enabled(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",), None])
    [plugin] = plugins_for(nvml, tmp_path, {"migStrategy": "none"})

    devices = await plugin.discover()

    assert [d.id for d in devices] == [g.uuid for g in nvml.gpus]


# ----------------------------------------------------------------------------- sharing and setup


async def test_time_slicing_advertises_replicas_of_each_gpu_under_a_shared_name(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    config = {"sharing": {"timeSlicing": {"replicas": 4, "renameByDefault": True}}}
    [plugin] = plugins_for(nvml, tmp_path, config)

    devices = await plugin.discover()

    assert plugin.resource_name == "nvidia.com/gpu.shared"
    assert len(devices) == 16
    assert devices[5].id == f"{nvml.gpus[1].uuid}::1"
    assert devices[5].parent == nvml.gpus[1].uuid


async def test_replicas_of_one_gpu_are_one_visible_gpu_in_the_container(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, replicas=2)
    devices = await plugin.discover()

    allocation = await plugin.allocate([devices[0], devices[1], devices[2]])

    assert allocation.env["NVIDIA_VISIBLE_DEVICES"] == f"{nvml.gpus[0].uuid},{nvml.gpus[1].uuid}"
    assert [n.host_path for n in allocation.device_nodes] == [
        "/dev/nvidia0",
        *CONTROL,
        "/dev/nvidia1",
    ]


async def test_fail_requests_greater_than_one_refuses_two_shared_gpus(tmp_path: Path) -> None:
    plugin = plugin_for(
        fake_nvml.t4_pcie(), tmp_path, replicas=2, fail_requests_greater_than_one=True
    )
    devices = await plugin.discover()
    await plugin.allocate(devices[:1])

    with pytest.raises(AllocationError, match="maximum request size for shared resources is 1"):
        await plugin.allocate(devices[:2])


async def test_envvar_strategy_lists_uuids_in_request_order(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()

    allocation = await plugin.allocate([devices[6], devices[2]])

    assert allocation.env == {"NVIDIA_VISIBLE_DEVICES": f"{nvml.gpus[6].uuid},{nvml.gpus[2].uuid}"}
    assert allocation.mounts == ()
    assert allocation.cdi_devices == ()


async def test_volume_mounts_strategy_mounts_dev_null_per_gpu(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, device_list_strategy=("volume-mounts",))
    devices = await plugin.discover()

    allocation = await plugin.allocate(devices[:2])

    assert allocation.env == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert allocation.mounts == tuple(
        Mount("/dev/null", f"/var/run/nvidia-container-devices/{g.uuid}") for g in nvml.gpus[:2]
    )


async def test_cdi_strategy_names_the_devices_for_the_runtime(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb", "1g.10gb")])
    plugin = plugin_for(
        nvml, tmp_path, mig_strategy="single", device_list_strategy=("cdi", "envvar")
    )
    devices = await plugin.discover()

    allocation = await plugin.allocate(devices)

    migs = [m.uuid for m in nvml.gpus[0].migs]
    assert allocation.cdi_devices == tuple(f"nvidia.com/gpu={m}" for m in migs)
    assert allocation.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(migs)


async def test_device_specs_can_be_left_to_the_runtime(tmp_path: Path) -> None:
    plugin = plugin_for(fake_nvml.t4_pcie(), tmp_path, pass_device_specs=False)
    devices = await plugin.discover()

    allocation = await plugin.allocate(devices[:1])

    assert allocation.device_nodes == ()
    assert list(allocation.env) == ["NVIDIA_VISIBLE_DEVICES"]


# ----------------------------------------------------------------------------- configuration


def test_config_reads_the_nvidia_like_yaml_form() -> None:
    config = NvidiaConfig.from_mapping(
        {
            "version": "v1",
            "migStrategy": "mixed",
            "deviceListStrategy": ["cdi", "volume-mounts"],
            "cdiKind": "k8s.device-plugin.nvidia.com/gpu",
            "passDeviceSpecs": False,
            "sharing": {
                "timeSlicing": {
                    "replicas": 10,
                    "renameByDefault": True,
                    "failRequestsGreaterThanOne": True,
                }
            },
            "health": {
                "disabled": False,
                "ignoredXids": [13, 43],
                "probeInterval": 2,
                "recoveryPeriod": None,
            },
            "sysfsRoot": "/host/sys",
            "devRoot": "/host/dev",
            "procRoot": "/host/proc",
        }
    )

    assert config == NvidiaConfig(
        mig_strategy="mixed",
        device_list_strategy=("cdi", "volume-mounts"),
        cdi_kind="k8s.device-plugin.nvidia.com/gpu",
        pass_device_specs=False,
        replicas=10,
        rename_by_default=True,
        fail_requests_greater_than_one=True,
        ignored_xids=frozenset({13, 43}),
        probe_interval=2.0,
        recovery_period=None,
        sysfs_root=Path("/host/sys"),
        dev_root=Path("/host/dev"),
        proc_root=Path("/host/proc"),
    )


def test_an_empty_config_means_nvidias_defaults() -> None:
    config = NvidiaConfig.from_mapping({})

    assert config == NvidiaConfig()
    assert config.ignored_xids == {109}


@pytest.mark.parametrize(
    ("config", "key", "reason"),
    [
        ({"migStrategy": "all"}, "migStrategy", "must be one of none, single, mixed"),
        ({"deviceListStrategy": ["envvar", "cdi-cri"]}, "deviceListStrategy[1]", "must be one of"),
        ({"deviceListStrategy": []}, "deviceListStrategy", "non-empty list"),
        ({"deviceListStrategy": ["envvar", "volume-mounts"]}, "deviceListStrategy", "pick one"),
        ({"cdiKind": "nvidia"}, "cdiKind", "vendor.com/class"),
        ({"passDeviceSpecs": "yes"}, "passDeviceSpecs", "true or false"),
        ({"sharing": {"timeSlicing": {"replicas": 0}}}, "sharing.timeSlicing.replicas", ">= 1"),
        (
            {"sharing": {"timeSlicing": {"replicas": True}}},
            "sharing.timeSlicing.replicas",
            "integer",
        ),
        (
            {"sharing": {"timeSlicing": {"resources": []}}},
            "sharing.timeSlicing.resources",
            "replicas",
        ),
        ({"sharing": {"mps": {}}}, "sharing.mps", "not supported"),
        ({"sharing": []}, "sharing", "must be a mapping"),
        ({"health": {"ignoredXids": [13, "x"]}}, "health.ignoredXids[1]", "integer >= 1"),
        ({"health": {"ignoredXids": 13}}, "health.ignoredXids", "list of integers"),
        ({"health": {"probeInterval": 0}}, "health.probeInterval", "> 0"),
        ({"health": {"recoveryPeriod": -1}}, "health.recoveryPeriod", ">= 0"),
        ({"health": {"recoverPeriod": 5}}, "health.recoverPeriod", "unknown key"),
        ({"healthz": {}}, "healthz", "unknown key"),
        ({"devRoot": ""}, "devRoot", "non-empty string"),
        ({"sysfsRoot": "host/sys"}, "sysfsRoot", "absolute path"),
        ({"procRoot": 7}, "procRoot", "non-empty string"),
        ({"version": "v2"}, "version", "must be one of v1"),
        ({"resourceName": "gpu"}, "resourceName", "invalid resource name"),
        ({"health": {"probeInterval": "5s"}}, "health.probeInterval", "number of seconds"),
        ({"health": []}, "health", "must be a mapping"),
        ({"containerEnv": {}}, "containerEnv", "unknown key"),
        ({"helth": {}}, "helth", "did you mean .health."),
    ],
)
def test_invalid_config_names_the_dotted_key(config: dict[str, Any], key: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as caught:
        from_config(config)

    assert caught.value.key == key


def test_a_resource_name_too_long_once_shared_is_a_config_error() -> None:
    name = "example.com/" + "g" * 60  # valid; with ".shared" 67 characters after the '/'
    config = {
        "resourceName": name,
        "sharing": {"timeSlicing": {"replicas": 2, "renameByDefault": True}},
    }

    with pytest.raises(ConfigError, match="longer than 63") as caught:
        from_config(config)

    assert caught.value.key == "resourceName"


def test_a_config_that_is_not_a_mapping_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        from_config([1, 2])  # type: ignore[arg-type]


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(
        ["none", "mixed", "cdi", "envvar", "/x", "a.b/c", "v1", "GiB", "MiB", "spread"]
    ),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(_KEYS), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=5))
def test_from_config_raises_only_config_error(config: dict[str, Any]) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",), None])  # mixed strategy reads NVML in from_config
    with nvml.installed(), contextlib.suppress(ConfigError):
        from_config(config)
    assert nvml.init_count == 0  # reading MIG profiles leaves NVML as it found it


def test_mig_profile_plugins_need_the_mixed_strategy() -> None:
    with pytest.raises(ValueError, match="mixed"):
        NvmlPlugin(NvidiaConfig(), mig_profile="1g.10gb")


# ----------------------------------------------------------------------------- placement


async def preferred(plugin: NvmlPlugin, size: int, must: Sequence[int] = ()) -> list[int]:
    devices = await plugin.discover()
    index = {d.id: int(d.attributes["index"]) for d in devices}
    chosen = await plugin.preferred_allocation(devices, [devices[i] for i in must], size)
    return [index[c] for c in chosen]


async def test_dgx_a100_pairs_come_from_one_pcie_switch(tmp_path: Path) -> None:
    plugin = plugin_for(fake_nvml.dgx_a100(), tmp_path)

    pair = await preferred(plugin, 2)

    assert sorted(pair) in ([0, 1], [2, 3], [4, 5], [6, 7])
    assert await preferred(plugin, 2, must=[5]) == [5, 4]


async def test_hgx_h100_four_gpus_come_from_one_numa_node(tmp_path: Path) -> None:
    plugin = plugin_for(fake_nvml.hgx_h100(), tmp_path)

    chosen = await preferred(plugin, 4, must=[6])

    assert sorted(chosen) == [4, 5, 6, 7]


async def test_t4_box_without_nvlink_keeps_pairs_under_one_pcie_switch(tmp_path: Path) -> None:
    plugin = plugin_for(fake_nvml.t4_pcie(), tmp_path)

    assert await preferred(plugin, 2, must=[2]) == [2, 3]


async def test_direct_nvlinks_are_counted_from_the_remote_pci_address(tmp_path: Path) -> None:
    # DGX-1-like direct links: GPU0 has two links to GPU2 and one to GPU1; no NVSwitch.
    def gpu(i: int, links: list[int]) -> FakeGPU:
        return FakeGPU(
            index=i,
            uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            name="Tesla V100-SXM2-32GB",
            memory_mib=32768,
            bus_id=f"00000000:{0x10 * (i + 1):02X}:00.0",
            minor=i,
            numa_node=0,
            pcie_path=("rc0", f"sw{i}"),
            nvlinks=[
                (f"00000000:{0x10 * (j + 1):02X}:00.0", fake_nvml.NVML_NVLINK_DEVICE_TYPE_GPU)
                for j in links
            ],
        )

    nvml = FakeNVML([gpu(0, [2, 2, 1]), gpu(1, [0]), gpu(2, [0, 0])])
    plugin = plugin_for(nvml, tmp_path)

    assert await preferred(plugin, 2, must=[0]) == [0, 2]
    assert await preferred(plugin, 2, must=[1]) == [1, 0]


async def test_replicas_are_spread_over_distinct_gpus(tmp_path: Path) -> None:
    plugin = plugin_for(fake_nvml.dgx_a100(), tmp_path, replicas=4)
    devices = await plugin.discover()

    chosen = await plugin.preferred_allocation(devices, [], 3)

    assert len({c.split("::")[0] for c in chosen}) == 3


async def test_a_lost_gpu_does_not_break_placement_for_the_others(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()
    nvml.lose(4)
    healthy = [d for d in devices if d.attributes["index"] != 4]

    chosen = await plugin.preferred_allocation(healthy, [healthy[4]], 2)

    assert len(chosen) == 2
    assert chosen[0] == nvml.gpus[5].uuid
    assert nvml.gpus[4].uuid not in chosen


async def test_topology_is_read_once_and_reused(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()

    await plugin.preferred_allocation(devices, [], 2)
    calls = nvml.calls["nvmlDeviceGetTopologyCommonAncestor"]
    await plugin.preferred_allocation(devices[2:], [], 4)

    assert calls == 28
    assert nvml.calls["nvmlDeviceGetTopologyCommonAncestor"] == 28


async def test_a_gpu_missing_from_the_topology_is_read_again_once_it_answers(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()
    nvml.lose(1)
    await plugin.preferred_allocation([d for d in devices if d.id != nvml.gpus[1].uuid], [], 2)
    nvml.recover(1)

    chosen = await plugin.preferred_allocation(devices, [devices[0]], 2)

    assert chosen == [nvml.gpus[0].uuid, nvml.gpus[1].uuid]  # its PCIe switch partner
