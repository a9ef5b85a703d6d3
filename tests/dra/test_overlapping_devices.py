"""One claim holding devices that overlap each other (issue 36, row 19).

A scheduler that allocated a GPU and one of its own MIG devices to one claim (or two partitions
whose counters add up past their GPU's) had the claim prepared: the container got both, the memory
counted twice. The driver refuses such a claim alone, naming both devices; partitions that fit
together are prepared as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sdk_helpers import figures

from devplugin_sdk import Device, DeviceNode
from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.dra import device_name
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DraNode, StaticPlugin, fake_nvml
from devplugin_sdk.types import Partition, Quantity

DRIVER = "gpu.nvidia.com"


async def test_a_gpu_and_its_own_mig_device_in_one_claim_are_refused(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), None])
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        mig_strategy="mixed",
    )
    mig_gpu, _ = nvml.gpus
    whole = device_name(mig_gpu.uuid)
    small = device_name(mig_gpu.migs[2].uuid)
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER) as node:
        pod = node.pod("both", namespace="ml")
        # The scheduler's counters forbid it; one that allocated it anyway:
        claim = node.claim(
            "both", {"gpu": [whole], "mig": [small]}, pods=[pod], namespace="ml", check=False
        )
        with pytest.raises(PodPreparationError) as refused:
            await node.prepare(pod)
        assert f"the claim holds device {whole} and its own partition {small}" in str(refused.value)
        assert not node.spec_path(claim).exists()
        # Nothing is held: the GPU alone is prepared for the next claim.
        node.api.delete_claim("ml", "both")
        alone = node.pod("gpu", namespace="ml")
        node.claim("gpu", {"gpu": [whole]}, pods=[alone], namespace="ml")
        assert (await node.prepare(alone)).cdi_ids("gpu")
    figures("row 19", refused="gpu + its mig", prepared_after=1)


def _partitions() -> list[Device]:
    """A device g0 of 4 memory units as three partitions: a and b take 3 units each (two
    placements that overlap), c one."""
    whole = Device("g0", device_nodes=(DeviceNode("/dev/g0"),))

    def part(name: str, units: int) -> Device:
        return Device(
            name,
            device_nodes=(DeviceNode(f"/dev/{name}"),),
            partition=Partition(whole, {"memory": Quantity(4)}, {"memory": Quantity(units)}),
        )

    return [part("g0-a", 3), part("g0-b", 3), part("g0-c", 1)]


async def test_two_partitions_that_overlap_in_one_claim_are_refused() -> None:
    plugin = StaticPlugin("acme.com/part", _partitions())
    async with DraNode(plugin, driver="part.acme.com") as node:
        pod = node.pod("ab")
        claim = node.claim("ab", ["g0-a", "g0-b"], pods=[pod], check=False)
        with pytest.raises(PodPreparationError) as refused:
            await node.prepare(pod)
        message = str(refused.value)
        assert "the claim holds partitions g0-a and g0-b of device g0, which overlap" in message
        assert "together they take 6 of its memory, which has 4" in message
        assert not node.spec_path(claim).exists()
        # Partitions that fit together are one claim's, as before.
        node.api.delete_claim("default", "ab")
        fits = node.pod("ac")
        node.claim("ac", ["g0-a", "g0-c"], pods=[fits])
        assert (await node.prepare(fits)).cdi_ids("ac")
