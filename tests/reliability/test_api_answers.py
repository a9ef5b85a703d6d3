"""Odd answers from the API server (issue 36, rows 7 and 25): HTML from a proxy, a 503 with an odd
body, a list where an object goes, 100k-deep JSON and garbage, through the real client (lightkube)
on the loopback API server.

Each is a ``KubeApiError`` of the call it answered (its status, a short printable reason), never an
exception that escapes: the driver process serves on, the publisher and the sweep retry, and one
claim whose read failed gets its own error while the kubelet's other claims are prepared.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from dra_helpers import DRIVER, devplugin_process, driver_run_file
from kube_apiserver import A_LIST, DEEP, GARBAGE, HTML, ODD_503, FakeApiServer, Raw
from sdk_helpers import RESOURCE, figures, widgets

from devplugin_sdk.dra import ResourceSlice, SliceDevice
from devplugin_sdk.dra._kube import LightkubeApi
from devplugin_sdk.dra.resources import ClaimDeviceStatus, NodeEvent
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DraNode, MemoryApi, StaticPlugin
from devplugin_sdk.types import DeviceStatus

NODE = "node-1"
ODD = {"html": HTML, "503": ODD_503, "list": A_LIST, "deep": DEEP, "garbage": GARBAGE}
# A 404 whose body is a proxy's page, not the API server's Status: it proves nothing.
PROXY_404 = Raw(404, b"<html>404 Not Found</html>", "text/html")
# A Status with the wrong shape where a refusal's Status goes.
ODD_STATUS = Raw(500, b'{"kind": "Status", "code": "many", "message": ["x"]}')


def _printable(text: str) -> bool:
    return text.isprintable() and "\x1b" not in text


@pytest.mark.parametrize("answer", [*ODD.values(), PROXY_404, ODD_STATUS], ids=[*ODD, "404", "st"])
async def test_every_call_turns_an_odd_answer_into_its_own_error(
    tmp_path: Path, answer: Raw
) -> None:
    memory = MemoryApi(nodes=[NODE])
    memory.add_claim("ns", "c")
    made = await memory.create_slice(ResourceSlice("", DRIVER, NODE, NODE, 1, 1))
    async with FakeApiServer(memory).serving() as server:
        api = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        claim = await api.read_claim("ns", "c")
        calls = {
            ("GET", "/resourceclaims/c"): lambda: api.read_claim("ns", "c"),
            ("GET", "/resourceslices"): lambda: api.list_slices(DRIVER, NODE),
            ("POST", "/resourceslices"): lambda: api.create_slice(
                ResourceSlice("", DRIVER, NODE, NODE, 1, 1, (SliceDevice("w0"),))
            ),
            ("PUT", made.name): lambda: api.update_slice(made),
            ("DELETE", made.name): lambda: api.delete_slice(made.name),
            ("GET", f"/nodes/{NODE}"): lambda: api.node_uid(NODE),
            ("PATCH", "/status"): lambda: api.apply_claim_status(
                claim, DRIVER, [ClaimDeviceStatus(DRIVER, NODE, "w0", DeviceStatus())]
            ),
            ("POST", "/events"): lambda: api.create_event(
                NodeEvent(NODE, "", "Reason", "message", "Warning", DRIVER)
            ),
        }
        reasons = []
        try:
            for (method, path), call in calls.items():
                server.answer_next(method, path, answer)
                with anyio.fail_after(10):
                    try:
                        await call()
                    except KubeApiError as exc:
                        reasons.append(exc)
                    else:
                        # A write whose answer is not read may take a 2xx of any body.
                        assert path in (made.name, "/events", "/status"), (method, path)
                        assert answer.status < 300, (method, path)
                assert not server.odd_pending(), (method, path)
            # The client works on: the next answers are the API server's own.
            assert (await api.read_claim("ns", "c")).uid == claim.uid
        finally:
            await api.aclose()
    # Each call whose answer is read, and with a refusal the writes too.
    assert len(reasons) == (len(calls) if answer.status >= 300 else len(calls) - 3)
    for exc in reasons:
        assert exc.status == answer.status, exc
        assert len(str(exc)) <= 400, str(exc)
        assert _printable(str(exc)), str(exc)
        assert exc.malformed
        assert not exc.not_found  # a proxy's 404 page is no proof that the claim is gone


async def test_a_watch_line_of_deep_json_is_an_error_of_that_watch(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        server.watch_lines.append(DEEP.body)
        api = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            with anyio.fail_after(10), pytest.raises(KubeApiError) as raised:
                async for _ in api.watch_slices(DRIVER, NODE):
                    pass
        finally:
            await api.aclose()
    assert raised.value.malformed
    assert len(str(raised.value)) <= 400


async def test_one_claims_odd_answer_fails_that_claim_alone(tmp_path: Path) -> None:
    """Row 25: three claims in one NodePrepareResources, the second's read answered with
    garbage: that claim gets an error, the other two are prepared."""
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        kubeconfig = server.kubeconfig(tmp_path / "k")
        plugin = StaticPlugin(RESOURCE, widgets(3))
        async with DraNode(
            plugin, driver=DRIVER, memory=memory, api=None, kubeconfig=kubeconfig
        ) as node:
            pod = node.pod("a", "b", "c", namespace="ns")
            claims = {
                name: node.claim(name, [f"w{i}"], pods=[pod], namespace="ns")
                for i, name in enumerate("abc")
            }
            server.answer_next("GET", "/resourceclaims/b", GARBAGE)
            with pytest.raises(PodPreparationError) as failed:
                await node.prepare(pod)
            assert "claim ns/b" in str(failed.value)
            assert "cannot read ResourceClaim ns/b" in str(failed.value)
            assert node.spec(claims["a"]).devices
            assert node.spec(claims["c"]).devices
            assert not node.spec_path(claims["b"]).exists()
            # The kubelet asks again: b is read anew and prepared; a and c keep their answer.
            prepared = await node.prepare(pod)
            assert all(prepared.cdi_ids(name) for name in "abc")
    figures("row 25", claims=3, failed=1, prepared_beside_it=2)


class _Raising:
    """Another ``ResourceApi`` (not the SDK's client) whose read of claim ``b`` raises what it
    likes; everything else goes to ``memory``."""

    def __init__(self, memory: MemoryApi) -> None:
        self.memory = memory

    def __getattr__(self, name: str) -> Any:
        return getattr(self.memory, name)

    async def read_claim(self, namespace: str, name: str) -> Any:
        if name == "b":
            raise RuntimeError("a client's own failure\n")
        return await self.memory.read_claim(namespace, name)


async def test_any_failure_of_another_resource_api_fails_that_claim_alone() -> None:
    memory = MemoryApi(nodes=[NODE])
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with DraNode(plugin, driver=DRIVER, memory=memory, api=_Raising(memory)) as node:
        pod = node.pod("a", "b")
        a = node.claim("a", ["w0"], pods=[pod])
        node.claim("b", ["w1"], pods=[pod])
        with pytest.raises(PodPreparationError) as failed:
            await node.prepare(pod)
        assert "claim default/b: cannot read ResourceClaim default/b: RuntimeError" in str(
            failed.value
        )
        assert node.spec(a).devices


@pytest.mark.timeout(90)  # a real `devplugin run` process through every odd answer
async def test_the_driver_process_survives_every_odd_answer(tmp_path: Path) -> None:
    """Row 7: a slice LIST answered with HTML at start, each odd answer to a claim's GET, and
    garbage to the sweep's read of a prepared claim: the process serves on, the claim a running
    pod holds stays prepared, and each kind of fault is one log line, with no traceback."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(2):
        (dev / f"ttyUSB{i}").touch()
    memory = MemoryApi(nodes=[NODE])
    node = DraNode(driver="serial.example.com", memory=memory, timeout=30)
    async with FakeApiServer(memory).serving() as server, node:
        kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
        # The sweep at the least interval a run file takes (it waits 8-12 s).
        config = driver_run_file(
            tmp_path / "config.yaml", node, kubeconfig, dev, cleanupInterval=10
        )
        server.answer_next("GET", "/resourceslices", HTML)  # the publisher's first list
        proc = devplugin_process("run", "--config", str(config))
        started = time.monotonic()
        try:
            await node.ready()
            ready_s = time.monotonic() - started
            assert server.odd_answered == 1
            first, second = sorted(node.published())
            held = node.pod("held", namespace="ns")
            node.claim("held", [first], pods=[held], namespace="ns")
            assert (await node.prepare(held)).cdi_ids("held")
            for name, answer in ODD.items():
                pod = node.pod(name, namespace="ns")
                node.claim(name, [second], pods=[pod], namespace="ns", check=False)
                server.answer_next("GET", f"/resourceclaims/{name}", answer)
                with pytest.raises(PodPreparationError, match=f"claim ns/{name}"):
                    await node.prepare(pod)
                assert proc.poll() is None, f"exited after {name}"
            # The sweep's read of the held claim, answered with garbage; then read again.
            server.answer_next("GET", "/resourceclaims/held", GARBAGE)
            count = server.odd_answered + 1
            with anyio.fail_after(40):  # up to two sweeps of 8-12 s each
                await server.wait_answered(count)
                claims = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/held"
                await server.wait_for_count("GET", claims, server.count("GET", claims) + 1)
            assert proc.poll() is None, "exited after the sweep's garbage"
            assert (await node.prepare(held)).cdi_ids("held")  # still prepared: the same answer
            proc.send_signal(signal.SIGTERM)
            _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=20))
        finally:
            proc.kill()
            # Shown when the test fails: how the process ended (rc 1, "JSON is malformed").
            print("rc", proc.poll(), proc.communicate()[1][-3000:])
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "\x1b" not in stderr
    # Each odd answer is said once, on one line (the publisher's, a claim's, the sweep's).
    said = [
        line
        for line in stderr.splitlines()
        if "the answer is not a" in line or "without a Status" in line
    ]
    assert len(said) == server.odd_answered == 2 + len(ODD), said
    figures("row 7", rc=proc.returncode, odd_answers=server.odd_answered, ready_s=ready_s)


async def test_the_api_servers_own_refusal_keeps_its_code_and_message(tmp_path: Path) -> None:
    """A ``Status`` is the API server's word: its code, its message (printable), not malformed;
    a 404 Status proves the claim gone."""
    memory = MemoryApi(nodes=[NODE])
    message = "ResourceSlice is invalid:\n" + "; ".join(
        f"spec.devices[{i}]: bad" for i in range(40)
    )
    refused = Raw(422, json.dumps({"kind": "Status", "code": 422, "message": message}).encode())
    async with FakeApiServer(memory).serving() as server:
        api = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            server.answer_next("POST", "/resourceslices", refused)
            with pytest.raises(KubeApiError) as invalid:
                await api.create_slice(ResourceSlice("", DRIVER, NODE, NODE, 1, 1))
            with pytest.raises(KubeApiError) as gone:
                await api.read_claim("ns", "nope")
        finally:
            await api.aclose()
    assert (invalid.value.status, invalid.value.malformed) == (422, False)
    assert invalid.value.reason.startswith("ResourceSlice is invalid:\\nspec.devices[0]: bad")
    assert len(invalid.value.reason) > 300  # the API server's message is kept (up to 1 KiB)
    assert gone.value.not_found
    assert not gone.value.malformed
