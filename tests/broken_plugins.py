"""Device plugins written straight on grpc.aio, each with at most one deliberate protocol fault.

The SDK makes most faults impossible, so these plugins implement v1beta1.DevicePlugin by hand,
the way a plugin in another language would. ``RawPlugin()`` with no fault passes the whole
conformance suite (the control); ``FAULTS`` maps each fault to the level each check must give
it (``fail`` where the kubelet breaks, ``warn`` where it copes); ``RawPlugin("empty-preferred")``
answers GetPreferredAllocation as the kubelet's own stub plugin does, and passes with a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import grpc

from devplugin_sdk._wire.server import unary
from devplugin_sdk.api import constants
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc

RESOURCE = "broken.example.com/dev"
SLOW_OPTIONS_S = 0.6  # used with Limits(fast_within=0.2)

# fault -> {check: level}: the first check is the one it targets; others follow from it.
FAULTS: dict[str, dict[str, str]] = {
    "slow-options": {"options-fast": "warn"},
    "no-initial-list": {"list-prompt": "fail"},
    "oversized-list": {"list-size": "fail"},
    "duplicate-ids": {"ids-unique-valid": "fail"},
    "long-id": {"ids-unique-valid": "warn"},
    "lowercase-health": {"health-values": "fail"},
    "negative-numa": {"topology-valid": "warn"},
    # The broken device is also part of "all healthy devices".
    "one-device-fails": {"allocate-each-device": "fail", "allocate-all-healthy": "fail"},
    # Both later Allocate checks re-send IDs allocated before.
    "not-idempotent": {"allocate-all-healthy": "fail", "allocate-multi-container": "warn"},
    "first-container-only": {"allocate-multi-container": "warn"},
    # A sharing rule: no container gets more than two devices; each alone is fine.
    "refuses-combinations": {"allocate-all-healthy": "warn"},
    # The kubelet fails the pod on no response and reads only the first of several.
    "no-container-response": {
        "allocate-each-device": "fail",
        "allocate-all-healthy": "fail",
        "allocate-multi-container": "warn",
    },
    "extra-container-response": {
        "allocate-each-device": "warn",
        "allocate-all-healthy": "warn",
        "allocate-multi-container": "warn",
    },
    "accepts-unknown": {"unknown-ids-rejected": "warn"},
    "preferred-fails": {"preferred-allocation": "fail"},
    "preferred-ignores-request": {"preferred-allocation": "warn"},
    "preferred-wrong-size": {"preferred-allocation": "warn"},
    "preferred-unavailable": {"preferred-allocation": "warn"},
    "prestart-unimplemented": {"prestart-answers": "fail"},
    # One stream at a time: the stream opened after a disconnect starves as well.
    "single-stream": {"second-stream": "fail", "survives-disconnect": "fail"},
    "ends-stream": {"stream-stays-open": "fail"},
    "dies-on-disconnect": {"survives-disconnect": "fail"},
}
# Faults that only --register-dir can see.
REGISTER_FAULTS: dict[str, dict[str, str]] = {
    "subdir-endpoint": {"registration-valid": "warn"},
    "no-reregister": {"reregisters-after-restart": "fail"},
}
LONG_ID = "dev-" + "x" * 70


def _devices(fault: str | None) -> list[pb.Device]:
    devices = [
        pb.Device(ID=f"dev-{i}", health=constants.HEALTHY, topology=_numa(i % 2)) for i in range(6)
    ]
    devices.append(pb.Device(ID="dev-sick", health=constants.UNHEALTHY))
    if fault == "duplicate-ids":
        devices.append(pb.Device(ID="dev-0", health=constants.HEALTHY, topology=_numa(0)))
    if fault == "lowercase-health":
        devices.append(pb.Device(ID="dev-odd", health="healthy"))
    if fault == "negative-numa":
        devices.append(pb.Device(ID="dev-far", health=constants.HEALTHY, topology=_numa(-1)))
    if fault == "long-id":
        devices.append(pb.Device(ID=LONG_ID, health=constants.UNHEALTHY))
    return devices


def _padding(count: int) -> bytes:
    """``count`` unhealthy devices, encoded by hand (fast): a ListAndWatchResponse is one
    repeated field, so encoded entries simply concatenate onto the message."""
    entries = []
    for i in range(count):
        device_id = f"pad-{i:06d}-{'x' * 50}".encode()  # 61 bytes: one-byte lengths below
        device = b"\x0a" + bytes([len(device_id)]) + device_id + b"\x12\x09Unhealthy"
        entries.append(b"\x0a" + bytes([len(device)]) + device)
    return b"".join(entries)


def _numa(node: int) -> pb.TopologyInfo:
    return pb.TopologyInfo(nodes=[pb.NUMANode(ID=node)])


@dataclass
class RawPlugin:
    """A hand-written v1beta1 device plugin with one optional ``fault`` (see ``FAULTS``)."""

    fault: str | None = None
    devices: list[pb.Device] = field(default_factory=list)
    allocated: set[str] = field(default_factory=set)
    streams: int = 0
    server: grpc.aio.Server | None = None
    known: set[str] = field(default_factory=set)
    payload: bytes = b""
    _stopping: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = _devices(self.fault)
        self.known = {d.ID for d in self.devices}
        self.payload = pb.ListAndWatchResponse(devices=self.devices).SerializeToString()
        if self.fault == "oversized-list":
            # 60,000 more devices of 76 bytes each make a message over 4 MiB.
            self.payload += _padding(60_000)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "v1beta1.DevicePlugin",
            {
                "GetDevicePluginOptions": unary(self.options, pb.Empty, pb.DevicePluginOptions),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self.list_and_watch,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=bytes,
                ),
                "GetPreferredAllocation": unary(
                    self.preferred, pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
                ),
                "Allocate": unary(self.allocate, pb.AllocateRequest, pb.AllocateResponse),
                "PreStartContainer": unary(
                    self.pre_start, pb.PreStartContainerRequest, pb.PreStartContainerResponse
                ),
            },
        )

    # ---------------------------------------------------------------------------------- RPCs

    async def options(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        if self.fault == "slow-options":
            await anyio.sleep(SLOW_OPTIONS_S)
        return pb.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    async def list_and_watch(self, request: pb.Empty, context: Any) -> AsyncIterator[bytes]:
        self.streams += 1
        try:
            if self.fault == "single-stream" and self.streams > 1:
                await anyio.sleep_forever()  # one shared queue: the second stream starves
            if self.fault == "no-initial-list":
                await anyio.sleep_forever()  # sends only when something changes (never)
            yield self.payload
            if self.fault == "ends-stream":
                return
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            if self.fault == "dies-on-disconnect" and self.server is not None:
                # An unhandled error in the disconnect path takes the whole server down (from
                # another task: a handler cannot wait for its own server to stop).
                server, self.server = self.server, None
                self._stopping = asyncio.get_running_loop().create_task(server.stop(0))
            raise
        finally:
            self.streams -= 1

    async def preferred(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        if self.fault == "empty-preferred":
            # The kubelet's stub plugin (dm/plugin/v1beta1/stub.go): no preference, ever.
            return pb.PreferredAllocationResponse()
        if self.fault == "preferred-fails":
            await context.abort(grpc.StatusCode.INTERNAL, "topology not read yet")
        responses = []
        for container in request.container_requests:
            size = container.allocation_size
            must = list(container.must_include_deviceIDs)
            rest = [i for i in container.available_deviceIDs if i not in must]
            if self.fault == "preferred-ignores-request":
                # Picks from its own list, ignoring must-include and the available set.
                ids = [d.ID for d in self.devices if d.health == constants.HEALTHY][:size]
            elif self.fault == "preferred-wrong-size":
                ids = (must + rest)[: size + 1] if len(must + rest) > size else (must + rest)[:-1]
            elif self.fault == "preferred-unavailable":
                ids = [*must, "dev-sick", *rest][:size]  # an unhealthy device among them
            else:
                ids = (must + rest)[:size]
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        responses = []
        for container in request.container_requests:
            ids = list(container.devices_ids)
            unknown = [i for i in ids if i not in self.known]
            if unknown and self.fault != "accepts-unknown":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
            if self.fault == "not-idempotent" and self.allocated & set(ids):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "already allocated")
            if self.fault == "refuses-combinations" and len(ids) > 2:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "at most 2 devices per container"
                )
            if self.fault == "one-device-fails" and "dev-5" in ids:
                await context.abort(grpc.StatusCode.INTERNAL, "/dev/dev-5: no such file")
            self.allocated |= set(ids)
            responses.append(
                pb.ContainerAllocateResponse(
                    envs={"BROKEN_DEVICES": ",".join(ids)},
                    devices=[
                        pb.DeviceSpec(
                            host_path=f"/dev/{i}", container_path=f"/dev/{i}", permissions="rw"
                        )
                        for i in ids
                    ],
                )
            )
        if self.fault == "first-container-only":
            responses = responses[:1]
        if self.fault == "no-container-response":
            responses = []
        if self.fault == "extra-container-response":
            responses = [*responses, pb.ContainerAllocateResponse()]
        return pb.AllocateResponse(container_responses=responses)

    async def pre_start(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        if self.fault == "prestart-unimplemented":
            # Advertised, but the method was never written.
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        return pb.PreStartContainerResponse()

    # ---------------------------------------------------------------------------------- serving

    async def start(self, path: Path) -> None:
        await anyio.Path(path.parent).mkdir(parents=True, exist_ok=True)
        await anyio.Path(path).unlink(missing_ok=True)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([self.handler()])
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        self.server = server

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.stop(0)
        if self._stopping is not None:
            await self._stopping


@contextlib.asynccontextmanager
async def serving_raw(path: Path, fault: str | None = None) -> AsyncIterator[RawPlugin]:
    """Serve a ``RawPlugin`` on ``path`` (no registration) for the body of the ``async with``."""
    plugin = RawPlugin(fault)
    await plugin.start(path)
    try:
        yield plugin
    finally:
        with anyio.CancelScope(shield=True):
            await plugin.stop()


async def _register(directory: Path, endpoint: str) -> None:
    async with grpc.aio.insecure_channel(
        f"unix:{directory / constants.KUBELET_SOCKET_NAME}"
    ) as channel:
        await pb_grpc.RegistrationStub(channel).Register(
            pb.RegisterRequest(
                version=constants.VERSION,
                endpoint=endpoint,
                resource_name=RESOURCE,
                options=pb.DevicePluginOptions(
                    pre_start_required=True, get_preferred_allocation_available=True
                ),
            ),
            timeout=15,
            wait_for_ready=True,
        )


def _kubelet_identity(directory: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(directory / constants.KUBELET_SOCKET_NAME)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


async def run_registered(directory: Path, fault: str | None = None) -> None:
    """Serve a ``RawPlugin`` and register it on ``directory``/kubelet.sock until cancelled.

    Re-registers (new server on a fresh socket) whenever kubelet.sock is recreated, found by
    polling its inode, unless the fault is ``no-reregister``.
    """
    endpoint = "sub/raw.sock" if fault == "subdir-endpoint" else "raw.sock"
    plugin = RawPlugin(fault)
    seen: tuple[int, int] | None = None
    try:
        while True:
            current = _kubelet_identity(directory)
            if current is not None and current != seen:
                if seen is not None and fault == "no-reregister":
                    await anyio.sleep_forever()
                seen = current
                await plugin.stop()
                await plugin.start(directory / endpoint)
                await _register(directory, endpoint)
            await anyio.sleep(0.02)  # this plugin polls for kubelet restarts, as many do
    finally:
        with anyio.CancelScope(shield=True):
            await plugin.stop()


async def serve_not_grpc(path: Path, task_status: anyio.abc.TaskStatus[None]) -> None:
    """Accept connections on ``path`` and answer with HTTP/1.1, not gRPC, until cancelled."""

    async def answer(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.BrokenResourceError):  # the client may go first
                await stream.send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    async with await anyio.create_unix_listener(path) as listener:
        task_status.started()
        await listener.serve(answer)


async def serve_silent(path: Path, task_status: anyio.abc.TaskStatus[None]) -> None:
    """Accept connections on ``path`` and never say anything (a hung server)."""

    async def hang(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async with await anyio.create_unix_listener(path) as listener:
        task_status.started()
        await listener.serve(hang)
