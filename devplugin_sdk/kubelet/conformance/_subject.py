"""The device plugin under test: the connections and ListAndWatch streams the checks share, and
what earlier checks found (options, first list, registration) for the later ones."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc

from devplugin_sdk._limits import Limits
from devplugin_sdk.kubelet.conformance._report import Skip
from devplugin_sdk.kubelet.fake import Registration
from devplugin_sdk.kubelet.probe import (
    DeviceList,
    ListStream,
    PluginClient,
    PluginOptions,
    ProbeError,
)

__all__ = ["MEASURE_LIMIT", "Subject", "flags"]

# Conformance reads ListAndWatch with a larger limit than the kubelet's so that it can report
# the size of an oversized message instead of only the kubelet's RESOURCE_EXHAUSTED.
MEASURE_LIMIT = 64 * 1024 * 1024


class Subject:
    """The plugin under test and the connections and streams the checks share."""

    def __init__(self, path: Path, limits: Limits) -> None:
        self.path = path
        self.limits = limits
        self.client: PluginClient | None = None
        self.options: PluginOptions | None = None
        self.first: DeviceList | None = None
        self.primary: ListStream | None = None
        self.primary_end: str | None = None
        self.updates = 0
        self.largest = 0
        self.registration: Registration | None = None
        self._clients: list[PluginClient] = []
        self._streams: list[ListStream] = []
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Subject:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        # Stop the background reader first: a grpc read interrupted by a local cancel of its
        # call raises CancelledError, which must not look like a cancellation of the task.
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close_connections()

    async def connect(self) -> PluginClient:
        """A new connection to the plugin, closed at the end of the run."""
        client = await PluginClient.connect(
            self.path,
            timeout=self.limits.timeout,
            rpc_timeout=self.limits.timeout,
            max_receive_bytes=MEASURE_LIMIT,
        )
        self._clients.append(client)
        return client

    def keep_open(self, stream: ListStream) -> None:
        self._streams.append(stream)

    async def close_connections(self) -> None:
        for stream in self._streams:
            stream.cancel()
        for client in self._clients:
            await client.close()
        self._clients.clear()
        self._streams.clear()

    def start_draining(self, stream: ListStream) -> None:
        """Read the primary stream in the background, recording updates and its end."""
        assert self._tg is not None
        self.primary = stream
        self.keep_open(stream)
        self._tg.start_soon(self._drain, stream)

    async def _drain(self, stream: ListStream) -> None:
        try:
            async for devices in stream:
                self.updates += 1
                self.largest = max(self.largest, devices.size)
        except ProbeError as exc:
            self.primary_end = str(exc)

    def need_client(self) -> PluginClient:
        if self.client is None:
            raise Skip("needs a connection (dial failed)")
        return self.client

    def need_options(self) -> PluginOptions:
        if self.options is None:
            raise Skip("needs the plugin's options (options-fast failed)")
        return self.options

    def need_list(self) -> DeviceList:
        if self.first is None:
            raise Skip("needs the first device list (list-prompt failed)")
        return self.first

    def healthy_ids(self, at_least: int = 1) -> list[str]:
        ids = list(dict.fromkeys(d.id for d in self.need_list().healthy))
        if len(ids) < at_least:
            raise Skip(
                f"needs {at_least} healthy device{'s' if at_least > 1 else ''}, "
                f"the plugin lists {len(ids)}"
            )
        return ids


def flags(options: PluginOptions) -> str:
    return (
        f"pre_start_required={str(options.pre_start_required).lower()}, "
        f"get_preferred_allocation_available={str(options.preferred_allocation).lower()}"
    )
