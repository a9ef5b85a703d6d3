"""``resource.kubernetes.io/numaNode`` (KEP-6072, stable in 1.37): every built-in backend that
knows a device's NUMA node publishes it under the standard name, as an int, so that one
``matchAttribute`` constraint can keep a GPU and a NIC of two drivers on one NUMA node; a device
whose node is unknown (sysfs ``-1``) carries no such attribute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devplugin_sdk.backends import fpga, generic, rdma
from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.testing import fake_nvml
from devplugin_sdk.testing.device_trees import amd_gpu_host
from devplugin_sdk.testing.fpga_trees import dfl_pac_host
from devplugin_sdk.testing.rdma_trees import connectx_ib_host
from devplugin_sdk.types import Device

NUMA = "resource.kubernetes.io/numaNode"


def numa(devices: list[Device]) -> dict[str, Any]:
    return {d.id: d.attributes.get(NUMA) for d in devices}


async def test_nvidia_gpus_carry_their_numa_node(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    nvml.gpus[2].numa_node = None  # the fake writes -1, as the kernel does
    roots = nvml.write_host(tmp_path)
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root
    )
    devices = await NvmlPlugin(config, nvml=nvml).discover()
    found = [d.attributes.get(NUMA) for d in devices]
    assert found == [3, 3, None, 1, 7, 7, 5, 5]
    assert all(type(v) is int for v in found if v is not None)
    assert NUMA not in devices[2].attributes


async def test_rdma_devices_carry_their_numa_node(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    (plugin,) = rdma.RdmaPlugin.from_config(
        {
            "sysfsRoot": str(host.sysfs_root),
            "devRoot": str(host.dev_root),
            "resources": [{"resourceName": "rdma/ib", "selectors": {"linkTypes": ["InfiniBand"]}}],
        }
    )
    assert numa(await plugin.discover()) == {"mlx5_0": 0, "mlx5_1": 1}


async def test_fpga_ports_carry_their_numa_node(tmp_path: Path) -> None:
    host, _ = dfl_pac_host(tmp_path)
    found: dict[str, Any] = {}
    for plugin in fpga.FpgaPlugin.from_config(
        {"sysfsRoot": str(host.sysfs_root), "devRoot": str(host.dev_root), "family": "dfl"}
    ):
        found.update(numa(await plugin.discover()))
    assert found == {"0000:5e:00.0-port0": 0, "0000:af:00.0-port0": 1}


async def test_generic_pci_cards_carry_their_numa_node_and_unknown_is_left_out(
    tmp_path: Path,
) -> None:
    host = amd_gpu_host(tmp_path)
    host.add_pci_function(
        "0000:00:02.0", vendor="0x8086", device="0x4680", pci_class="0x030000", driver="i915"
    )
    host.add_drm_card("0000:00:02.0", card=3, render=130)
    (plugin,) = generic.from_config(
        {
            "sysfsRoot": str(host.sysfs_root),
            "devRoot": str(host.dev_root),
            "resources": [
                {
                    "resourceName": "amd.com/gpu",
                    "groups": [
                        {
                            "groupBy": "pciDevice",
                            "paths": [{"path": "/dev/dri/renderD*"}, {"path": "/dev/dri/card*"}],
                        }
                    ],
                }
            ],
        }
    )
    found = numa(await plugin.discover())
    # numa_node -1 (the integrated GPU): no attribute rather than a made-up node.
    assert found == {"0000:00:02.0": None, "0000:03:00.0": 0, "0000:83:00.0": 1}
