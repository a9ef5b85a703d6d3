"""The device-plugin checks of the connection, the registration and ListAndWatch: what the
kubelet needs before a pod can ask for the resource, and for the resource to stay."""

from __future__ import annotations

import time
from collections import Counter

from devplugin_sdk import _names
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.conformance._report import (
    BOTH,
    FAIL,
    WARN,
    Check,
    CheckFailed,
    CheckWarning,
    Skip,
    ms,
    plural,
)
from devplugin_sdk.kubelet.conformance._subject import MEASURE_LIMIT, Subject, flags
from devplugin_sdk.kubelet.probe import PluginClient, ProbeError

__all__ = ["LISTING_CHECKS", "MAX_ID_LENGTH", "STREAM_CHECKS"]

# The API's comment on Device.ID; the kubelet itself does not enforce it.
MAX_ID_LENGTH = 63


async def _dial(s: Subject) -> str:
    # The kubelet dials once per registration, blocking, with a 10 s timeout.
    s.client = await s.connect()
    return f"connected in {ms(s.client.connect_seconds)}"


async def _options_fast(s: Subject) -> str:
    client = s.need_client()
    started = time.perf_counter()
    options = await client.options()
    elapsed = time.perf_counter() - started
    s.options = options
    if elapsed > s.limits.fast_within:
        # The kubelet calls it inside Register, with no deadline: registration waits on it.
        raise CheckWarning(
            f"answered in {ms(elapsed)}, over {ms(s.limits.fast_within)}; the kubelet calls it "
            "inside Register and the plugin's registration waits for it"
        )
    return f"answered in {ms(elapsed)} ({flags(options)})"


async def _registration_valid(s: Subject) -> str:
    reg = s.registration
    if reg is None:
        raise Skip("no registration recorded")
    problems: list[str] = []
    if reg.error is not None:
        problems.append(f"the kubelet rejected it: {reg.error}")
    if reg.version != constants.VERSION:
        problems.append(f"version {reg.version!r} is not {constants.VERSION!r}")
    name_problem = _names.resource_name_problem(reg.resource_name)
    if name_problem is not None:
        problems.append(f"resource name {reg.resource_name!r} is invalid: {name_problem}")
    if problems:
        raise CheckFailed("; ".join(problems))
    try:
        # Only files directly in the directory are wiped at kubelet start (restart detection);
        # the kubelet itself joins any endpoint onto the directory and dials it.
        _names.validate_socket_name(reg.endpoint)
    except ValueError as exc:
        problems.append(
            f"endpoint must be a bare socket file name in the directory: {exc}; the kubelet "
            "dials it, but never deletes it when it restarts"
        )
    if s.options is not None and (
        reg.pre_start_required != s.options.pre_start_required
        or reg.preferred_allocation != s.options.preferred_allocation
    ):
        # The kubelet reads no RegisterRequest.options: GetDevicePluginOptions is what it uses.
        problems.append(
            "RegisterRequest.options (pre_start_required="
            f"{str(reg.pre_start_required).lower()}, get_preferred_allocation_available="
            f"{str(reg.preferred_allocation).lower()}) differ from GetDevicePluginOptions "
            f"({flags(s.options)}), which is all the kubelet reads"
        )
    if problems:
        raise CheckWarning("; ".join(problems))
    return f"{reg.resource_name} registered {reg.version} with endpoint {reg.endpoint!r}"


async def _list_prompt(s: Subject) -> str:
    client = s.need_client()
    stream = client.list_and_watch()
    try:
        devices = await stream.next(timeout=s.limits.timeout)
    except TimeoutError:
        stream.cancel()
        raise CheckFailed(
            f"no ListAndWatch message within {s.limits.timeout:g} s; the plugin must send the "
            "full device list as soon as the stream opens (capacity stays 0 until it does)"
        ) from None
    elapsed = time.perf_counter() - stream.opened_at
    s.first = devices
    s.largest = devices.size
    s.start_draining(stream)
    if elapsed > s.limits.fast_within:
        raise CheckWarning(
            f"first message after {ms(elapsed)}, over {ms(s.limits.fast_within)}; pods "
            "admitted before it fail with UnexpectedAdmissionError"
        )
    return (
        f"first message after {ms(elapsed)}: {plural(len(devices.devices), 'device')} "
        f"({len(devices.healthy)} healthy)"
    )


async def _list_size(s: Subject) -> str:
    first = s.need_list()
    size = max(first.size, s.largest)
    if size > constants.MAX_MESSAGE_BYTES:
        # grpc-go's default receive limit, which the kubelet never raises.
        raise CheckFailed(
            f"a ListAndWatch message is {size} bytes, over the kubelet's 4 MiB receive limit "
            f"({constants.MAX_MESSAGE_BYTES} bytes): the kubelet ends the stream and drops the "
            "resource; split the devices over several resources"
        )
    return f"{first.size} bytes for {plural(len(first.devices), 'device')} (limit 4 MiB)"


async def _ids_unique_valid(s: Subject) -> str:
    devices = s.need_list().devices
    counts = Counter(d.id for d in devices)
    duplicates = [(i, n) for i, n in counts.items() if n > 1]
    if duplicates:
        device_id, n = duplicates[0]
        # The kubelet does not reject duplicates: it may count one ID twice in capacity.
        raise CheckFailed(
            f"ID {device_id!r} is listed {n} times ({len(duplicates)} duplicated IDs); "
            "IDs must be unique within the resource"
        )
    # The kubelet checks nothing else about IDs; they show in pod status and podresources.
    for device in devices:
        if not device.id:
            raise CheckWarning("a device has an empty ID")
        if not device.id.isprintable():
            raise CheckWarning(f"ID {device.id!r} is not printable")
        if len(device.id) > MAX_ID_LENGTH:
            raise CheckWarning(
                f"ID {device.id[:24]!r}... is {len(device.id)} characters; the API limits IDs "
                f"to {MAX_ID_LENGTH} (the kubelet does not check it)"
            )
    if not devices:
        return "no devices listed (an empty list is valid)"
    return f"{plural(len(devices), 'unique printable ID')}"


async def _health_values(s: Subject) -> str:
    devices = s.need_list().devices
    for device in devices:
        if device.health not in (constants.HEALTHY, constants.UNHEALTHY):
            # The kubelet compares with the exact string "Healthy"; anything else is unhealthy.
            raise CheckFailed(
                f"device {device.id!r} has health {device.health!r}; only exactly 'Healthy' or "
                "'Unhealthy' (the kubelet treats every other value as unhealthy)"
            )
    healthy = sum(1 for d in devices if d.healthy)
    return f"{healthy} Healthy, {len(devices) - healthy} Unhealthy"


async def _topology_valid(s: Subject) -> str:
    devices = s.need_list().devices
    # The kubelet stores topology as given; a node that is not a machine's never aligns.
    for device in devices:
        if any(n < 0 for n in device.numa_nodes):
            raise CheckWarning(
                f"device {device.id!r} reports NUMA nodes {list(device.numa_nodes)}; NUMA IDs "
                "are >= 0 (omit topology when unknown): the kubelet never aligns it"
            )
        if len(set(device.numa_nodes)) != len(device.numa_nodes):
            raise CheckWarning(
                f"device {device.id!r} repeats a NUMA node: {list(device.numa_nodes)}"
            )
    with_topology = sum(1 for d in devices if d.numa_nodes)
    return f"{with_topology} of {len(devices)} devices report NUMA nodes"


async def _second_stream(s: Subject) -> str:
    s.need_list()
    client = await s.connect()
    stream = client.list_and_watch()
    s.keep_open(stream)
    try:
        devices = await stream.next(timeout=s.limits.timeout)
    except TimeoutError:
        raise CheckFailed(
            f"a second concurrent ListAndWatch stream got no message within "
            f"{s.limits.timeout:g} s; streams overlap after a re-registration and every one "
            "must get the full list"
        ) from None
    elapsed = time.perf_counter() - stream.opened_at
    return f"second stream got {plural(len(devices.devices), 'device')} after {ms(elapsed)}"


async def _stream_stays_open(s: Subject) -> str:
    s.need_list()
    if s.primary_end is not None:
        # Any end of the stream makes the kubelet mark every device unhealthy.
        raise CheckFailed(f"the first ListAndWatch stream ended: {s.primary_end}")
    assert s.primary is not None
    age = time.perf_counter() - s.primary.opened_at
    return f"first stream still open after {ms(age)} and {plural(s.updates, 'update')}"


async def _survives_disconnect(s: Subject) -> str:
    s.need_list()
    # Whether the first stream ended before is stream-stays-open's finding, not this one's.
    was_open = s.primary_end is None
    leaving = await PluginClient.connect(
        s.path, timeout=s.limits.timeout, max_receive_bytes=MEASURE_LIMIT
    )
    try:
        stream = leaving.list_and_watch()
        await stream.next(timeout=s.limits.timeout)
    except TimeoutError:
        raise CheckFailed(
            f"a new ListAndWatch stream got no message within {s.limits.timeout:g} s"
        ) from None
    finally:
        # Closing the channel mid-stream: the plugin sees the RPC cancelled.
        await leaving.close()
    try:
        client = await s.connect()
        await client.options()
        again = client.list_and_watch()
        s.keep_open(again)
        await again.next(timeout=s.limits.timeout)
    except (ProbeError, TimeoutError) as exc:
        raise CheckFailed(
            f"after a client disconnected mid-stream the plugin stopped serving: "
            f"{exc or 'no ListAndWatch message'}"
        ) from None
    if was_open and s.primary_end is not None:
        raise CheckFailed(
            f"after another client disconnected, the first stream ended: {s.primary_end}"
        )
    return "still serving after a client disconnected mid-stream"


#: Run first, in this order: the connection, the registration, the first list.
LISTING_CHECKS: tuple[Check[Subject], ...] = (
    Check(
        "dial",
        "the socket accepts a gRPC connection within the kubelet's 10 s",
        _dial,
        FAIL,
        "dm/plugin/client.go:dial dials once per registration, blocking, for 10 s; a failed "
        "dial fails the Register call (failed to dial device plugin)",
    ),
    Check(
        "options-fast",
        "GetDevicePluginOptions answers, quickly",
        _options_fast,
        BOTH,
        "dm/manager.go:PluginConnected calls it inside Register (dm/plugin/handler.go:"
        "connectClient) with no deadline: an error fails the registration (fail); a slow "
        "answer only delays it (warn)",
    ),
    Check(
        "registration-valid",
        "Register sends v1beta1, a valid resource name, a bare socket name and the same options "
        "as GetDevicePluginOptions",
        _registration_valid,
        BOTH,
        "dm/plugin/server.go:Register refuses another version or an invalid resource name "
        "(fail); it joins any endpoint onto its directory and reads no RegisterRequest.options, "
        "and dm/manager.go:CleanupPluginDirectory skips subdirectories at kubelet start "
        "(warn: the plugin's restart signal and declared options are lost)",
        register_only=True,
    ),
    Check(
        "list-prompt",
        "ListAndWatch sends the full list, promptly",
        _list_prompt,
        BOTH,
        "dm/manager.go:genericDeviceUpdateCallback creates the resource from the first "
        "message; until then dm/manager.go:devicesToAllocate fails every pod asking for it "
        "(cannot allocate unregistered device): never (fail), late (warn)",
    ),
    Check(
        "list-size",
        "every ListAndWatch message fits the kubelet's 4 MiB limit",
        _list_size,
        FAIL,
        "dm/plugin/client.go:Run reads with grpc-go's 4 MiB limit: a larger message ends the "
        "stream and dm/manager.go:PluginDisconnected marks every device unhealthy",
    ),
    Check(
        "ids-unique-valid",
        "device IDs are unique, non-empty, printable, at most 63 chars",
        _ids_unique_valid,
        BOTH,
        "dm/manager.go:genericDeviceUpdateCallback keeps one entry per ID and may count a "
        "duplicate twice in capacity (fail); it checks nothing else about IDs, which end up in "
        "the checkpoint, podresources and pod status (warn)",
    ),
    Check(
        "health-values",
        "health is exactly Healthy or Unhealthy",
        _health_values,
        FAIL,
        "dm/manager.go:genericDeviceUpdateCallback counts a device as healthy only if its "
        "health is exactly 'Healthy': any other string takes it out of allocatable",
    ),
    Check(
        "topology-valid",
        "NUMA node IDs are >= 0 and not repeated",
        _topology_valid,
        WARN,
        "dm/manager.go:genericDeviceUpdateCallback stores topology as given and "
        "dm/manager.go:filterByAffinity matches it against the NUMA hint: a node ID the "
        "machine lacks never aligns (the Topology Manager's intent is lost)",
    ),
)

#: Run last, after the allocation checks: a second stream, and a client that leaves mid-stream.
STREAM_CHECKS: tuple[Check[Subject], ...] = (
    Check(
        "second-stream",
        "a second concurrent ListAndWatch stream is served",
        _second_stream,
        FAIL,
        "dm/plugin/handler.go:runClient opens a stream per registration, and two overlap "
        "after a re-registration (v1.32): a stream without a list leaves the resource stale",
    ),
    Check(
        "stream-stays-open",
        "the plugin never ends a ListAndWatch stream",
        _stream_stays_open,
        FAIL,
        "dm/plugin/client.go:Run takes any end of the stream as the plugin gone: "
        "dm/manager.go:PluginDisconnected marks every device unhealthy and nothing redials",
    ),
    Check(
        "survives-disconnect",
        "the plugin keeps serving after a client disconnects mid-stream",
        _survives_disconnect,
        FAIL,
        "dm/plugin/server.go:Stop cancels every stream when the kubelet stops or restarts; a "
        "plugin that stops serving then cannot register again",
    ),
)
