"""Claim device status (KEP-4817) and device metadata (KEP-5304): the RDMA backend's
networkData in the claim's status through the real client and the loopback API server, the
limits the API server checks, and each request's metadata.json mounted by the claim's CDI spec
and removed with it."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
from dra_helpers import DRIVER
from kube_apiserver import FakeApiServer
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.backends import rdma
from devplugin_sdk.dra._kube import LightkubeApi
from devplugin_sdk.testing import ClaimSpec, DraNode, MemoryApi, StaticPlugin
from devplugin_sdk.testing.rdma_trees import connectx_roce_host
from devplugin_sdk.types import Device, DeviceCondition, DeviceStatus, NetworkData

NODE = "node-1"
METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"


def mounts(spec: ClaimSpec) -> list[dict[str, object]]:
    return [m for d in spec.devices for m in d["containerEdits"].get("mounts", [])]


async def test_rdma_claims_show_network_data_in_the_claim_status_on_the_loopback_api(
    tmp_path: Path,
) -> None:
    host = connectx_roce_host(tmp_path / "host", vfs=0)
    (plugin,) = rdma.RdmaPlugin.from_config(
        {
            "sysfsRoot": str(host.sysfs_root),
            "devRoot": str(host.dev_root),
            "resources": [{"resourceName": "rdma/roce", "selectors": {"rdmaDevices": ["mlx5_0"]}}],
        }
    )
    api = MemoryApi(nodes=[NODE])
    async with FakeApiServer(api).serving() as server:
        client = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            async with DraNode(plugin, driver=DRIVER, memory=api, api=client) as node:
                kubelet = node.kubelet
                (device,) = node.published()
                pod = node.pod("nic", name="trainer")
                node.claim("nic", {"nic": [device]}, pods=[pod])
                await node.prepare(pod)
                await kubelet.wait_for(
                    lambda: bool(api.device_statuses("default", "nic")), what="status"
                )
                (entry,) = api.device_statuses("default", "nic")
                assert (entry.driver, entry.pool, entry.device) == (DRIVER, NODE, device)
                assert entry.status.network_data == NetworkData(
                    interface_name="ens1f0np0", hardware_address="b8:ce:f6:00:00:00"
                )
                # Server-side apply, the driver as field manager.
                assert list(api.claim_status[("default", "nic")]) == [DRIVER]
                assert ("PATCH", "application/apply-patch+yaml") in server.content_types
                # The same network data in the request's metadata.json.
                uid = api.claims[("default", "nic")].uid
                (mount,) = mounts(node.spec(uid))
                document = json.loads(Path(str(mount["hostPath"])).read_text())  # noqa: ASYNC240
                (listed,) = document["requests"][0]["devices"]
                assert listed["networkData"] == {
                    "interfaceName": "ens1f0np0",
                    "hardwareAddress": "b8:ce:f6:00:00:00",
                }
                assert listed["attributes"]["rdmaDevice"] == {"string": "mlx5_0"}
                await node.unprepare(pod)
                # The driver's entries leave with the claim's preparation.
                await kubelet.wait_for(
                    lambda: not api.device_statuses("default", "nic"), what="status cleared"
                )
        finally:
            await client.aclose()


class Reporting(StaticPlugin):
    """Reports what ``answers`` holds for each device."""

    answers: ClassVar[dict[str, DeviceStatus | None]] = {}

    async def device_status(self, device: Device) -> DeviceStatus | None:
        return self.answers.get(device.id)


async def test_conditions_and_data_are_written_and_out_of_limit_answers_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    Reporting.answers = {
        "w0": DeviceStatus(
            conditions=(DeviceCondition("Ready", "True", "Configured", "link up"),),
            data={"firmware": "28.39.1002"},
        ),
        "w1": DeviceStatus(
            conditions=tuple(DeviceCondition(f"C{i}", "True", "Why") for i in range(9))
        ),
        "w2": DeviceStatus(data={"blob": "x" * (10 * 1024)}),
    }
    async with DraNode(Reporting(RESOURCE, widgets(3)), driver=DRIVER) as node:
        api = node.api
        pod = node.pod("c", name="p")
        node.claim("c", {"w": ["w0", "w1", "w2"]}, pods=[pod])
        with caplog.at_level(logging.WARNING, logger="devplugin_sdk"):
            prepared = await node.prepare(pod)
        assert prepared.cdi_ids("c")  # the claim prepared whatever the status
        (entry,) = api.device_statuses("default", "c")
        assert entry.device == "w0"
        assert entry.status.conditions[0].reason == "Configured"
        assert entry.status.data == {"firmware": "28.39.1002"}
        left_out = sorted(r.message for r in caplog.records if "left out" in r.message)
        assert len(left_out) == 2
        assert "9 conditions; at most 8" in left_out[0] or "9 conditions" in left_out[1]
        assert any("at most 10240" in m for m in left_out)


async def test_the_memory_api_refuses_what_the_api_server_refuses() -> None:
    from devplugin_sdk.dra.resources import ClaimDeviceStatus
    from devplugin_sdk.errors import KubeApiError

    api = MemoryApi(nodes=[NODE])
    claim = api.add_claim("default", "c")
    bad: Sequence[ClaimDeviceStatus] = [
        ClaimDeviceStatus(
            DRIVER, NODE, "w0", DeviceStatus(network_data=NetworkData(ips=("10.0.0.1",)))
        )
    ]
    with pytest.raises(KubeApiError) as error:
        await api.apply_claim_status(claim, DRIVER, bad)
    assert error.value.status == 422
    assert "allocated device" in error.value.reason
    assert "CIDR" in error.value.reason


async def test_metadata_json_per_request_is_mounted_by_the_claim_spec_and_removed_on_unprepare() -> (
    None
):
    plugin = StaticPlugin(
        RESOURCE,
        [
            dataclasses.replace(w, attributes={"index": i, "model": "W9"})
            for i, w in enumerate(widgets(2))
        ],
    )
    async with DraNode(plugin, driver=DRIVER) as node:
        api, options = node.api, node.options
        pod = node.pod("gpus", name="p", namespace="team")
        node.claim("gpus", {"big/large": ["w0"], "small": ["w1"]}, pods=[pod], namespace="team")
        await node.prepare(pod)
        claim = api.claims[("team", "gpus")]
        found = {
            str(m["containerPath"]): Path(str(m["hostPath"])) for m in mounts(node.spec(claim))
        }
        big = f"{METADATA_ROOT}/resourceclaims/gpus/big/{DRIVER}-metadata.json"
        small = f"{METADATA_ROOT}/resourceclaims/gpus/small/{DRIVER}-metadata.json"
        assert sorted(found) == [big, small]
        host_file = found[big]
        # Keyed by the claim's UID on the host (issue 36: a claim re-created under its name is
        # another claim); by its name in the container.
        assert (
            host_file
            == options.resolved_plugin_dir
            / "dra-device-metadata"
            / claim.uid
            / "big"
            / "metadata.json"
        )
        document = json.loads(host_file.read_text())
        assert document == {
            "apiVersion": "metadata.resource.k8s.io/v1alpha1",
            "kind": "DeviceMetadata",
            "metadata": {
                "name": "gpus",
                "namespace": "team",
                "uid": claim.uid,
                "generation": 1,
            },
            "requests": [
                {
                    "name": "big/large",  # the full name inside, the base name in the path
                    "devices": [
                        {
                            "driver": DRIVER,
                            "pool": NODE,
                            "name": "w0",
                            "attributes": {"index": {"int": 0}, "model": {"string": "W9"}},
                        }
                    ],
                }
            ],
        }
        assert oct(host_file.stat().st_mode & 0o777) == "0o644"
        (spec_mount,) = [m for m in mounts(node.spec(claim)) if m["containerPath"] == big]
        assert "ro" in spec_mount["options"]  # type: ignore[operator]
        await node.unprepare(pod)
        assert not host_file.exists()
        assert not (options.resolved_plugin_dir / "dra-device-metadata" / claim.uid).exists()


async def test_a_claim_from_a_template_is_mounted_under_its_pod_claim_name() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(1)), driver=DRIVER) as node:
        api = node.api
        pod = node.pod("trainer-gpus-x7k2p", name="trainer")
        api.add_claim("default", "trainer-gpus-x7k2p", pod_claim_name="gpus")
        node.claim("trainer-gpus-x7k2p", {"gpu": ["w0"]}, pods=[pod])
        await node.prepare(pod)
        claim = api.claims[("default", "trainer-gpus-x7k2p")]
        (mount,) = mounts(node.spec(claim))
        assert mount["containerPath"] == (
            f"{METADATA_ROOT}/resourceclaimtemplates/gpus/gpu/{DRIVER}-metadata.json"
        )
        document = json.loads(Path(str(mount["hostPath"])).read_text())  # noqa: ASYNC240
        assert document["podClaimName"] == "gpus"
