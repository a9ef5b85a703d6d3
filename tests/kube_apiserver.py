"""A loopback Kubernetes API server for the DRA tests: the few REST paths a DRA kubelet plugin
uses, over a ``MemoryApi``, so that the real client (lightkube) is tested on the wire.

It speaks HTTP/1.1 on 127.0.0.1 (keep-alive, chunked watch streams) and serves GET of a
ResourceClaim and a Node, server-side apply of a claim's status (its ``status.devices[]``), POST
of a Node Event, and list, watch, create, replace and delete of ResourceSlices with
field selectors, answering errors as the API server does (a ``Status`` with code and message).
A watch ends after its ``timeoutSeconds``, as the API server's does, and one that asked for
bookmarks gets one every ``bookmark_period`` seconds when that is set (the API server's cacher
sends one a minute, ``defaultBookmarkFrequency``). Fault hooks: ``watch_fault`` ("end": every
watch ends at once, as behind a proxy that closes them; "silent": the connection stays open and
nothing more arrives, as on a dead TCP connection), ``silence()`` (the watches open now go
silent so, the later ones work), ``conflicts`` (every PUT is a 409), ``mutate`` (a mutating
admission webhook: applied to every slice written), ``edit_claims`` (applied to every claim
served, e.g. another valid spelling of a quantity), ``answer_next`` (the next matching requests
get raw bytes: HTML from a proxy, a 503 with an odd body, a list, deep JSON, garbage),
``watch_lines`` (raw lines a watch sends before its events).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
from lightkube.resources.resource_v1 import ResourceSlice as KubeSlice

from devplugin_sdk.dra._kube import device_status_to_kube, slice_from_kube, slice_to_kube
from devplugin_sdk.dra.resources import ClaimDeviceStatus, NodeEvent, ResourceClaim, ResourceSlice
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.testing import MemoryApi
from devplugin_sdk.types import DeviceCondition, DeviceStatus, NetworkData

_SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _slice_json(s: ResourceSlice) -> dict[str, Any]:
    data: dict[str, Any] = slice_to_kube(s).to_dict()
    data["apiVersion"] = "resource.k8s.io/v1"
    data["kind"] = "ResourceSlice"
    return data


@dataclass(frozen=True)
class Raw:
    """One answer as bytes on the wire, whatever a proxy or a broken server may send."""

    status: int
    body: bytes
    content_type: str = "application/json"


#: Odd answers an API server, or a proxy in front of it, has been seen to give.
HTML = Raw(200, b"<html><body><h1>Welcome to nginx!</h1></body></html>", "text/html")
ODD_503 = Raw(503, b"upstream connect error or disconnect/reset before headers")
A_LIST = Raw(200, b'[{"kind": "ResourceClaim"}]')
DEEP = Raw(200, b'{"a":' * 100_000 + b"1" + b"}" * 100_000)  # 100k-deep JSON
GARBAGE = Raw(200, b"\x00\xff\x1b[2J not json {")


def _status(code: int, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "code": code,
    }


class FakeApiServer:
    """Serves ``api`` over HTTP until the ``serving`` context ends.

    Attributes:
        requests: ``(method, path)`` of every request, in order.
        watch_queries: The query parameters of every watch request, in order.
        watch_fault: None, "end" or "silent" (see the module's docstring).
        conflicts: Answer every PUT with 409 Conflict.
        mutate: Applied to every slice a POST or PUT writes, before it is stored.
        bookmark_period: Seconds between the bookmarks of a watch that asked for them (None:
            none are sent).
        bookmarks: How many bookmarks were sent.
        node_labels: The labels each Node is served with, by node name.
    """

    def __init__(self, api: MemoryApi) -> None:
        self.api = api
        self.port = 0
        self.requests: list[tuple[str, str]] = []
        self.watch_queries: list[dict[str, str]] = []
        self.watch_fault: Literal["end", "silent"] | None = None
        self.conflicts = False
        self.mutate: Callable[[ResourceSlice], ResourceSlice] | None = None
        self.node_labels: dict[str, dict[str, str]] = {}
        self.bookmark_period: float | None = None
        self.bookmarks = 0  # bookmarks sent
        self._silenced = 0  # watches with a lower number than this send nothing more
        self.content_types: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.watch_lines: list[bytes] = []
        self.edit_claims: Callable[[dict[str, Any]], None] | None = None
        self._odd: list[tuple[str, str, Raw]] = []
        self.odd_answered = 0
        self._watched = anyio.Event()
        self._answered = anyio.Event()
        self._requested = anyio.Event()
        self._bookmarked = anyio.Event()

    def answer_next(self, method: str, path_suffix: str, *answers: Raw) -> None:
        """The next ``len(answers)`` requests of ``method`` to a path ending with
        ``path_suffix`` (a watch excepted) get ``answers``, in order, instead of the API's."""
        self._odd.extend((method, path_suffix, a) for a in answers)

    async def wait_for_count(self, method: str, path_prefix: str, count: int) -> None:
        """Wait until ``count`` requests of ``method`` went to paths starting with
        ``path_prefix``."""
        while self.count(method, path_prefix) < count:
            await self._requested.wait()

    def odd_pending(self) -> int:
        """How many answers given to ``answer_next`` are still to be sent."""
        return len(self._odd)

    async def wait_answered(self, count: int) -> None:
        """Wait until ``count`` odd answers have been sent in all."""
        while self.odd_answered < count:
            await self._answered.wait()

    def _take_odd(self, method: str, path: str) -> Raw | None:
        for i, (m, suffix, answer) in enumerate(self._odd):
            if m == method and path.endswith(suffix):
                del self._odd[i]
                return answer
        return None

    async def wait_for_bookmarks(self, count: int) -> None:
        """Wait until ``count`` bookmarks have been sent."""
        while self.bookmarks < count:
            await self._bookmarked.wait()

    def silence(self) -> None:
        """The watches open now send nothing more, their connections kept open (a dead TCP
        connection); watches opened later work."""
        self._silenced = len(self.watch_queries)

    async def wait_for_watches(self, count: int) -> None:
        """Wait until ``count`` watch requests have arrived."""
        while len(self.watch_queries) < count:
            await self._watched.wait()

    def count(self, method: str, path_prefix: str = _SLICES) -> int:
        """How many ``method`` requests went to paths starting with ``path_prefix``."""
        return sum(1 for m, p in self.requests if m == method and p.startswith(path_prefix))

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig pointing at this server; return its path."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}
                    ],
                    "users": [{"name": "driver", "user": {"token": "fake"}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "driver"}}
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[FakeApiServer]:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._connection)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    async def _connection(self, stream: anyio.abc.ByteStream) -> None:
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    try:
                        chunk = await stream.receive()
                    except (
                        anyio.EndOfStream,
                        anyio.BrokenResourceError,
                        anyio.ClosedResourceError,
                    ):
                        return
                    buffer += chunk
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    buffer += await stream.receive()
                body, buffer = buffer[:length], buffer[length:]
                url = urlsplit(target)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                self.requests.append((method, url.path))
                self._requested.set()
                self._requested = anyio.Event()
                if method == "GET" and url.path == _SLICES and query.get("watch") == "true":
                    # The connection stays open for the next request once a watch ends.
                    await self._watch(stream, query)
                    continue
                self.content_types.append((method, headers.get("content-type", "")))
                odd = self._take_odd(method, url.path)
                if odd is not None:
                    code, kind, data = odd.status, odd.content_type, odd.body
                else:
                    code, payload = await self._handle(method, url.path, query, body)
                    kind, data = "application/json", json.dumps(payload).encode()
                await stream.send(
                    f"HTTP/1.1 {code} X\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                if odd is not None:
                    self.odd_answered += 1
                    self._answered.set()
                    self._answered = anyio.Event()

    async def _handle(
        self, method: str, path: str, query: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]]:
        api = self.api
        try:
            if method == "GET" and path.startswith("/api/v1/nodes/"):
                name = path.rsplit("/", 1)[1]
                uid = await api.node_uid(name)
                return 200, {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "uid": uid,
                        "labels": self.node_labels.get(name, {}),
                    },
                }
            if method == "PATCH" and "/resourceclaims/" in path and path.endswith("/status"):
                return await self._apply_status(path, query, body)
            if (
                method == "POST"
                and path.startswith("/api/v1/namespaces/")
                and path.endswith("/events")
            ):
                return await self._event_created(path, body)
            if method == "GET" and "/resourceclaims/" in path:
                parts = path.split("/")
                claim = await api.read_claim(parts[-3], parts[-1])
                answer = _claim_json(claim)
                if self.edit_claims is not None:
                    self.edit_claims(answer)
                return 200, answer
            if path == _SLICES and method == "GET":
                node, driver = _selector(query)
                items = [_slice_json(s) for s in await api.list_slices(driver, node)]
                return 200, {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": str(api.generation)},
                    "items": items,
                }
            if path == _SLICES and method == "POST":
                made = await api.create_slice(self._admit(_parse_slice(body)))
                return 201, _slice_json(made)
            if path.startswith(_SLICES + "/") and method == "PUT":
                if self.conflicts:
                    name = path.rsplit("/", 1)[1]
                    return 409, _status(
                        409,
                        f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}":'
                        " the object has been modified",
                    )
                replaced = await api.update_slice(self._admit(_parse_slice(body)))
                return 200, _slice_json(replaced)
            if path.startswith(_SLICES + "/") and method == "DELETE":
                await api.delete_slice(path.rsplit("/", 1)[1])
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        except KubeApiError as exc:
            return exc.status or 500, _status(exc.status or 500, exc.reason)
        return 404, _status(404, f"the server could not find {method} {path}")

    async def _apply_status(
        self, path: str, query: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, Any]]:
        # Server-side apply (PATCH application/apply-patch+yaml, which JSON is): the API server
        # requires a fieldManager, and the UID in the body is a precondition.
        if self.content_types[-1][1] != "application/apply-patch+yaml":
            return 415, _status(415, f"unsupported patch type {self.content_types[-1][1]}")
        manager = query.get("fieldManager", "")
        if not manager:
            return 422, _status(422, "PatchOptions.meta.k8s.io: fieldManager: Required value")
        parts = path.split("/")
        namespace, name = parts[-4], parts[-2]
        data = json.loads(body)
        uid = str(data.get("metadata", {}).get("uid", ""))
        devices = [_device_status(d) for d in data.get("status", {}).get("devices", [])]
        await self.api.apply_claim_status(ResourceClaim(namespace, name, uid), manager, devices)
        claim = await self.api.read_claim(namespace, name)
        out = _claim_json(claim)
        out["status"]["devices"] = [
            device_status_to_kube(d) for d in self.api.device_statuses(namespace, name)
        ]
        return 200, out

    async def _event_created(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        data = json.loads(body)
        involved = data.get("involvedObject", {})
        if path.split("/")[4] != data.get("metadata", {}).get("namespace", path.split("/")[4]):
            return 400, _status(400, "the namespace of the object does not match the request")
        if involved.get("kind") != "Node":
            return 422, _status(422, "only Node events are modelled here")
        await self.api.create_event(
            NodeEvent(
                node_name=str(involved.get("name", "")),
                node_uid=str(involved.get("uid") or ""),
                reason=str(data.get("reason", "")),
                message=str(data.get("message", "")),
                type=data.get("type", "Normal"),
                component=str(data.get("source", {}).get("component") or ""),
            )
        )
        self.events.append(data)
        return 201, data

    def _admit(self, s: ResourceSlice) -> ResourceSlice:
        return self.mutate(s) if self.mutate is not None else s

    async def _watch(self, stream: anyio.abc.ByteStream, query: dict[str, str]) -> None:
        number = len(self.watch_queries)
        self.watch_queries.append(query)
        self._watched.set()
        self._watched = anyio.Event()
        node, driver = _selector(query)
        await stream.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            if self.watch_fault == "silent":
                await anyio.sleep_forever()
            while self.watch_lines:
                line = self.watch_lines.pop(0) + b"\n"
                await stream.send(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            if self.watch_fault != "end":
                # The API server ends a watch after its timeoutSeconds (or its own limit).
                with anyio.move_on_after(float(query.get("timeoutSeconds", "inf"))):
                    await _Watch(self, stream, number, query).run(node, driver)
            await stream.send(b"0\r\n\r\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return


class _Watch:
    """One watch of the loopback server: events as the API server sends them, bookmarks when
    asked for and ``bookmark_period`` is set, nothing once ``silence()`` caught it open."""

    def __init__(
        self,
        server: FakeApiServer,
        stream: anyio.abc.ByteStream,
        number: int,
        query: dict[str, str],
    ) -> None:
        self.server = server
        self.stream = stream
        self.number = number
        self.version = query.get("resourceVersion", "")
        self.bookmarks = query.get("allowWatchBookmarks") == "true"
        self.lock = anyio.Lock()

    async def run(self, node: str, driver: str) -> None:
        async with anyio.create_task_group() as tg:
            if self.bookmarks and self.server.bookmark_period is not None:
                tg.start_soon(self._bookmarks, self.server.bookmark_period)
            await self._events(node, driver)
            tg.cancel_scope.cancel()

    async def _events(self, node: str, driver: str) -> None:
        # As the API server: without a resourceVersion the current slices as ADDED, then every
        # change in order (a slice created and deleted between two reads is two events); from a
        # version, every change after it; an ERROR 410 when those are no longer remembered.
        try:
            async for event in self.server.api.watch_slices(driver, node, self.version):
                if event is not None and event.slice is not None:
                    stored = replace(event.slice, resource_version=event.resource_version)
                    await self._send(event.kind, _slice_json(stored))
                    self.version = event.resource_version
        except KubeApiError as exc:
            await self._send("ERROR", _status(exc.status or 500, exc.reason))

    async def _bookmarks(self, period: float) -> None:
        while True:
            await anyio.sleep(period)
            if self.version:
                meta = {"resourceVersion": self.version}
                await self._send("BOOKMARK", {"kind": "ResourceSlice", "metadata": meta})
                self.server.bookmarks += 1
                self.server._bookmarked.set()
                self.server._bookmarked = anyio.Event()

    async def _send(self, kind: str, obj: dict[str, Any]) -> None:
        if self.number < self.server._silenced:
            await anyio.sleep_forever()  # the connection stays up; nothing more arrives
        line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
        async with self.lock:
            await self.stream.send(f"{len(line):x}\r\n".encode() + line + b"\r\n")


def _selector(query: dict[str, str]) -> tuple[str, str]:
    fields = dict(part.split("=", 1) for part in query.get("fieldSelector", "").split(",") if part)
    return fields.get("spec.nodeName", ""), fields.get("spec.driver", "")


def _parse_slice(body: bytes) -> ResourceSlice:
    return slice_from_kube(KubeSlice.from_dict(json.loads(body)))


def _config_json(entry: Any) -> dict[str, Any]:
    """A ``status.allocation.devices.config`` entry (resource/v1 DeviceAllocationConfiguration)."""
    out: dict[str, Any] = {
        "source": entry.source,
        "opaque": {"driver": entry.driver, "parameters": entry.parameters},
    }
    if entry.requests:
        out["requests"] = list(entry.requests)
    return out


def _claim_json(claim: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "reservedFor": [
            {"resource": "pods", "name": "pod", "uid": uid} for uid in claim.reserved_for
        ]
    }
    if claim.allocated:
        status["allocation"] = {
            "devices": {
                "results": [_result_json(r) for r in claim.results],
                "config": [_config_json(c) for c in claim.config],
            }
        }
    metadata: dict[str, Any] = {
        "namespace": claim.namespace,
        "name": claim.name,
        "uid": claim.uid,
    }
    if claim.pod_claim_name:
        metadata["annotations"] = {"resource.kubernetes.io/pod-claim-name": claim.pod_claim_name}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": {"devices": {}},
        "status": status,
    }


def _result_json(r: Any) -> dict[str, Any]:
    """One allocation result, with a share's ID and consumed capacity and admin access when set
    (resource/v1 DeviceRequestAllocationResult)."""
    out: dict[str, Any] = {
        "request": r.request,
        "driver": r.driver,
        "pool": r.pool,
        "device": r.device,
    }
    if r.share_id:
        out["shareID"] = r.share_id
    if r.consumed:
        out["consumedCapacity"] = {k: str(v) for k, v in r.consumed.items()}
    if r.admin_access:
        out["adminAccess"] = True
    return out


def _device_status(raw: dict[str, Any]) -> ClaimDeviceStatus:
    net = raw.get("networkData")
    return ClaimDeviceStatus(
        raw["driver"],
        raw["pool"],
        raw["device"],
        DeviceStatus(
            conditions=tuple(
                DeviceCondition(c["type"], c["status"], c["reason"], c.get("message", ""))
                for c in raw.get("conditions", [])
            ),
            data=raw.get("data"),
            network_data=None
            if net is None
            else NetworkData(
                net.get("interfaceName", ""),
                tuple(net.get("ips", [])),
                net.get("hardwareAddress", ""),
            ),
        ),
    )
