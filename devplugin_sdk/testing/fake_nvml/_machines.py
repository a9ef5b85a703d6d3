"""Ready-made machines, the same UUIDs in every process: DGX A100 (80 GB and 40 GB GPUs), HGX
H100, a T4 server and an A100 with MIG instances.
"""

from __future__ import annotations

import uuid as uuid_module
from collections.abc import Callable, Sequence

from devplugin_sdk.testing.fake_nvml._constants import (
    NVML_DEVICE_ARCH_HOPPER,
    NVML_DEVICE_ARCH_TURING,
    NVML_NVLINK_DEVICE_TYPE_SWITCH,
)
from devplugin_sdk.testing.fake_nvml._fake import FakeNVML
from devplugin_sdk.testing.fake_nvml._model import (
    FakeGPU,
    FakeMIG,
    _uuid,
)


def dgx_a100() -> FakeNVML:
    """8x A100-SXM4-80GB on NVSwitch (12 NVLinks each, to 6 switches), as in a DGX A100.

    ECC on; Ampere remaps rows and retires no pages (that query answers Not Supported).

    GPU pairs (0,1) (2,3) (4,5) (6,7) share a PCIe switch tree; NUMA nodes 3, 1, 7, 5.
    """
    return _dgx_a100("dgx-a100", "NVIDIA A100-SXM4-80GB", 81920)


def dgx_a100_40gb() -> FakeNVML:
    """8x A100-SXM4-40GB (40960 MiB each), as in a DGX A100 320GB; otherwise as ``dgx_a100``
    (other UUIDs)."""
    return _dgx_a100("dgx-a100-40gb", "NVIDIA A100-SXM4-40GB", 40960)


def _dgx_a100(tag: str, name: str, memory_mib: int) -> FakeNVML:
    bus = ["07", "0F", "47", "4E", "87", "90", "B7", "BD"]
    numa = [3, 3, 1, 1, 7, 7, 5, 5]
    switches = [f"00000000:{0xC0 + i:02X}:00.0" for i in range(6)]
    gpus = [
        FakeGPU(
            index=i,
            uuid=_uuid("GPU", tag, i),
            name=name,
            memory_mib=memory_mib,
            bus_id=f"00000000:{bus[i]}:00.0",
            minor=i,
            numa_node=numa[i],
            pcie_path=(f"rc{i // 2}", f"sw{i // 2}", f"sw{i // 2}.{i % 2}"),
            nvlinks=[(switches[link // 2], NVML_NVLINK_DEVICE_TYPE_SWITCH) for link in range(12)],
            mig_capable=True,
            row_remapping=True,
        )
        for i in range(8)
    ]
    return FakeNVML(gpus)


def hgx_h100() -> FakeNVML:
    """8x H100 80GB HBM3 SXM on NVSwitch (18 NVLinks each, to 4 switches), as in an HGX H100.

    Each GPU sits behind its own PCIe switch; GPUs 0-3 on NUMA node 0, 4-7 on node 1. ECC on,
    rows remapped, no page retirement (as on every GPU since Ampere).
    """
    bus = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
    switches = [f"00000000:{0xE0 + i:02X}:00.0" for i in range(4)]
    link_switch = [0] * 4 + [1] * 5 + [2] * 5 + [3] * 4  # 18 links over 4 switches
    gpus = [
        FakeGPU(
            index=i,
            uuid=_uuid("GPU", "hgx-h100", i),
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            bus_id=f"00000000:{bus[i]}:00.0",
            minor=i,
            numa_node=i // 4,
            pcie_path=(f"rc{i}", f"sw{i}"),
            nvlinks=[(switches[s], NVML_NVLINK_DEVICE_TYPE_SWITCH) for s in link_switch],
            mig_capable=True,
            row_remapping=True,
            architecture=NVML_DEVICE_ARCH_HOPPER,
            compute_capability=(9, 0),
            # The fabric manager puts the NVSwitch domain's GPUs in one clique.
            fabric=(str(uuid_module.uuid5(uuid_module.NAMESPACE_URL, "fake-nvml/hgx-h100")), 1),
        )
        for i in range(8)
    ]
    return FakeNVML(gpus)


def t4_pcie() -> FakeNVML:
    """4x Tesla T4 on PCIe only: no NVLink, no MIG; (0,1) under one switch on NUMA 0, (2,3) on 1.

    ECC on; Turing retires pages and remaps no rows (that query answers Not Supported).
    """
    bus = ["3B", "3C", "AF", "B0"]
    gpus = [
        FakeGPU(
            index=i,
            uuid=_uuid("GPU", "t4", i),
            name="Tesla T4",
            memory_mib=15360,
            bus_id=f"00000000:{bus[i]}:00.0",
            minor=i,
            numa_node=i // 2,
            pcie_path=(f"rc{i // 2}", f"sw{i // 2}"),
            page_retirement=True,
            architecture=NVML_DEVICE_ARCH_TURING,
            compute_capability=(7, 5),
        )
        for i in range(4)
    ]
    return FakeNVML(gpus)


# A100-SXM4-80GB MIG profiles: name -> (GPU instance slices, compute slices, memory MiB),
# as `nvidia-smi mig -lgip` lists them.
A100_80GB_PROFILES: dict[str, tuple[int, int, int]] = {
    "1g.10gb": (1, 1, 9728),
    "1g.20gb": (1, 1, 19968),
    "2g.20gb": (2, 2, 19968),
    "3g.40gb": (3, 3, 40192),
    "4g.40gb": (4, 4, 40192),
    "7g.80gb": (7, 7, 80896),
    "1c.2g.20gb": (2, 1, 19968),
}


def a100_mig(
    layouts: Sequence[Sequence[str] | None] = (("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),),
) -> FakeNVML:
    """A100-SXM4-80GB GPUs with MIG: one GPU per layout (profile names), ``None`` = MIG off.

    Args:
        layouts: Per GPU, the MIG profiles created on it (keys of ``A100_80GB_PROFILES``).

    Raises:
        ValueError: an unknown profile name.
    """
    gpus: list[FakeGPU] = []
    for i, layout in enumerate(layouts):
        gpu_uuid = _uuid("GPU", "a100-mig", i)
        migs: list[FakeMIG] = []
        for j, profile in enumerate(layout or ()):
            if profile not in A100_80GB_PROFILES:
                raise ValueError(f"unknown A100 80GB MIG profile {profile!r}")
            gi_slices, ci_slices, memory = A100_80GB_PROFILES[profile]
            migs.append(
                FakeMIG(
                    uuid=_uuid("MIG", "a100-mig", i, j),
                    gi=j + 1,
                    ci=0,
                    gi_slices=gi_slices,
                    ci_slices=ci_slices,
                    memory_mib=memory,
                    multiprocessors=14 * ci_slices,
                )
            )
        gpus.append(
            FakeGPU(
                index=i,
                uuid=gpu_uuid,
                name="NVIDIA A100-SXM4-80GB",
                memory_mib=81920,
                bus_id=f"00000000:{0x07 + 8 * i:02X}:00.0",
                minor=i,
                numa_node=0,
                pcie_path=(f"rc{i}", f"sw{i}"),
                mig_capable=True,
                mig_enabled=layout is not None,
                row_remapping=True,
                migs=migs,
            )
        )
    return FakeNVML(gpus)


#: The machines ``python -m devplugin_sdk.testing.fake_nvml --machine NAME`` can model.
MACHINES: dict[str, Callable[[], FakeNVML]] = {
    "a100_mig": a100_mig,
    "dgx_a100": dgx_a100,
    "dgx_a100_40gb": dgx_a100_40gb,
    "hgx_h100": hgx_h100,
    "t4_pcie": t4_pcie,
}
