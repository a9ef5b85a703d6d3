"""Quantities as Kubernetes parses them (issue 36, row 18).

k8s.io/apimachinery ``pkg/api/resource/quantity.go``: a sign, digits with an optional fraction, and
a binary (Ki..Ei), decimal (n, u, m, k..E) or exponent (``e3``, ``E-2``) suffix; parsed exactly and
read as a whole amount rounded up, as ``Quantity.Value()`` does. A claim's consumed capacity in
any valid spelling (the API server keeps ``12e9`` and ``500m`` in that form) is its amount; before,
every spelling but digits with a suffix read as 0 and the claim was refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kube_apiserver import FakeApiServer
from sdk_helpers import figures

from devplugin_sdk.backends.nvidia import MemorySharing, NvidiaConfig, NvmlPlugin
from devplugin_sdk.dra import device_name
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DraNode, MemoryApi, fake_nvml
from devplugin_sdk.types import Quantity

GiB = 2**30
DRIVER = "gpu.nvidia.com"

ACCEPTED = [
    ("0", 0),
    ("-0", 0),
    ("4", 4),
    ("007", 7),
    ("80Gi", 80 * GiB),
    ("1.5Gi", 3 * 2**29),
    ("+1Gi", GiB),
    ("12e9", 12 * 10**9),
    ("12E9", 12 * 10**9),
    ("1e-3", 1),  # a thousandth, rounded up
    ("500m", 1),
    ("1500m", 2),
    ("2000m", 2),
    ("5n", 1),
    ("3u", 1),
    ("16k", 16_000),
    ("1E", 10**18),  # "E" alone is exa, not an exponent
    (".5", 1),
    ("1.", 1),
    ("1.1Ki", 1127),
    ("0.5Ki", 512),
    ("2.147483648e9", 2 * GiB),
    ("0e999", 0),
    ("8Ei", 2**63 - 1),  # a binary quantity is capped, as ParseQuantity caps it
    ("9223372036854775807", 2**63 - 1),
]
REFUSED = [
    "",
    ".",
    "+",
    " 1",
    "1 ",
    "1K",  # kilo is lower-case
    "1KB",
    "1.5GB",
    "1e",
    "1e+",
    "1e1.5",
    "1ee3",
    "1Ki2",
    "1i",
    "e3",
    "0x10",
    "\uff11\uff12",  # fullwidth digits
    "1_0",
    "-1",  # valid for Kubernetes; a capacity is never negative
    "9223372036854775808",  # a decimal quantity past 2**63-1
    "10E",
    "1e40",
]


@pytest.mark.parametrize(("text", "value"), ACCEPTED)
def test_a_kubernetes_quantity_parses_to_its_whole_amount(text: str, value: int) -> None:
    assert Quantity.parse(text).value == value


@pytest.mark.parametrize("text", REFUSED)
def test_what_kubernetes_refuses_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"[qQ]uantity"):
        Quantity.parse(text)


def test_what_is_published_parses_back() -> None:
    for value in (0, 1, 7, 1000, 1024, 1536, 12 * 10**9, 80 * GiB, 2**63 - 1):
        assert Quantity.parse(str(Quantity(value))).value == value


def _respelled(spelling: str) -> Any:
    def edit(claim: dict[str, Any]) -> None:
        for result in claim["status"].get("allocation", {}).get("devices", {}).get("results", []):
            if "consumedCapacity" in result:
                result["consumedCapacity"]["memory"] = spelling

    return edit


async def test_a_claims_consumed_capacity_in_any_spelling_gets_its_shares(tmp_path: Path) -> None:
    """gpushare-style GiB units of a 40 GiB GPU, claims of 2 GiB spelled as the API server may
    answer them; 1.5Gi (not whole units) is refused, naming the amount it read."""
    nvml = fake_nvml.dgx_a100_40gb()
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        memory=MemorySharing(unit="GiB"),
    )
    memory = MemoryApi(nodes=["node-1"])
    gpu0 = device_name(nvml.gpus[0].uuid)
    spellings = ["2Gi", "+2Gi", "2048Mi", "2147483648", "2.147483648e9", "2147483648000m"]
    async with FakeApiServer(memory).serving() as server:
        kubeconfig = server.kubeconfig(tmp_path / "k")
        async with DraNode(
            *NvmlPlugin.build(config, nvml=nvml),
            driver=DRIVER,
            memory=memory,
            api=None,
            kubeconfig=kubeconfig,
        ) as node:
            for n, spelling in enumerate(spellings):
                pod = node.pod(f"c{n}", namespace="ml")
                claim = node.claim(
                    f"c{n}",
                    {"gpu": [gpu0]},
                    pods=[pod],
                    namespace="ml",
                    capacity={"gpu": {"memory": Quantity(2 * GiB)}},
                )
                server.edit_claims = _respelled(spelling)
                await node.prepare(pod)
                (device,) = node.spec(claim).devices
                env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
                assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2", spelling
            pod = node.pod("half", namespace="ml")
            node.claim(
                "half",
                {"gpu": [gpu0]},
                pods=[pod],
                namespace="ml",
                capacity={"gpu": {"memory": Quantity(2 * GiB)}},
            )
            server.edit_claims = _respelled("1.5Gi")
            with pytest.raises(PodPreparationError, match="consumes 1536Mi of memory"):
                await node.prepare(pod)
    figures("row 18", spellings_prepared=len(spellings), refused_not_whole_units=1)
