"""``ResourceApi`` over a real API server, through lightkube (the ``dra`` extra).

lightkube is an async client on httpx, so it runs on the SDK's anyio/asyncio loop without
threads, and lightkube-models has typed resource.k8s.io/v1 models. This module converts between
those models and the SDK's ``dra.resources`` dataclasses, sends each request built by lightkube
and has ``_answer`` decode what comes back (anything but the expected object is a
``KubeApiError`` of that call), and bounds the watch (a server-side ``timeoutSeconds`` and a
client read timeout); it is imported only when a DRA driver connects.
"""

from __future__ import annotations

import datetime
import random
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import httpx2
import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.models import core_v1, meta_v1
from lightkube.models import resource_v1 as m
from lightkube.resources.core_v1 import Event as KubeEvent
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim as KubeClaim
from lightkube.resources.resource_v1 import ResourceSlice as KubeSlice
from lightkube.types import PatchType

from devplugin_sdk._logging import printable
from devplugin_sdk.dra import _answer
from devplugin_sdk.dra.resources import (
    AllocatedDevice,
    ClaimDeviceStatus,
    CounterConsumption,
    CounterSet,
    DeviceConfig,
    DeviceTaint,
    NodeEvent,
    RequestPolicy,
    ResourceClaim,
    ResourceSlice,
    SliceDevice,
    SliceEvent,
    TaintEffect,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.types import AttributeValue, Quantity, Version

__all__ = [
    "LightkubeApi",
    "claim_from_kube",
    "claim_status_apply",
    "event_to_kube",
    "slice_from_kube",
    "slice_to_kube",
]

#: The annotation on a claim made from a pod's ResourceClaimTemplate: the pod's name for it
#: (k8s.io/api resource/v1 PodResourceClaimAnnotation).
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
#: Where the kubelet records Node events, and so do we.
EVENT_NAMESPACE = "default"

# The field selectors the API server supports on ResourceSlices (ResourceSliceSelectorNodeName,
# ResourceSliceSelectorDriver in k8s.io/api resource/v1).
_NODE_FIELD = "spec.nodeName"
_DRIVER_FIELD = "spec.driver"
_FIELD_MANAGER = "devplugin-sdk"
# client-go's reflector asks for 5 to 10 minutes per watch (minWatchTimeout, jittered), so that
# the watches of many nodes do not end in step.
WATCH_TIMEOUT = 300.0
# A watch reads nothing while nothing changes: give the server its timeoutSeconds and this
# much more before the connection counts as dead.
_READ_GRACE = 30.0
#: How often the API server sends a bookmark on a quiet watch that asked for them (its cacher's
#: defaultBookmarkFrequency, one minute, k8s.io/apiserver pkg/storage/cacher/cacher.go, and one
#: 2 s before the watch's deadline): a watch that has read neither an event nor a bookmark for
#: two periods is on a dead connection, and is abandoned (the caller reopens it from its version).
BOOKMARK_PERIOD = 60.0
_CONNECT_TIMEOUT = 10.0

T = TypeVar("T")


class LightkubeApi:
    """``ResourceApi`` on a lightkube ``AsyncClient``.

    Args:
        client: The client (its configuration says which cluster and credentials).
        watch_timeout: Each watch asks the server to end it after this many seconds, times a
            random factor in [1, 2).
        read_timeout: Seconds a watch may read nothing before its connection counts as dead
            (default: two bookmark periods, or its timeoutSeconds plus 30 s if that is less).
        bookmark_period: How often the server sends a bookmark on a quiet watch.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        watch_timeout: float = WATCH_TIMEOUT,
        read_timeout: float | None = None,
        bookmark_period: float = BOOKMARK_PERIOD,
    ) -> None:
        self._client = client
        self._watch_timeout = watch_timeout
        self._read_timeout = read_timeout
        self._bookmark_period = bookmark_period

    @classmethod
    def connect(
        cls,
        kubeconfig: Path | None = None,
        *,
        watch_timeout: float = WATCH_TIMEOUT,
        read_timeout: float | None = None,
        bookmark_period: float = BOOKMARK_PERIOD,
    ) -> LightkubeApi:
        """A client from ``kubeconfig``, or from the pod's service account (the watch's
        bounds as in the class).

        Raises:
            ValueError: the configuration cannot be loaded.
        """
        try:
            config = (
                KubeConfig.from_file(kubeconfig)
                if kubeconfig is not None
                else KubeConfig.from_service_account()
            )
        except Exception as exc:
            where = kubeconfig or "the in-cluster service account"
            raise ValueError(
                f"cannot load the Kubernetes configuration from {where}: {exc}"
            ) from exc
        client = AsyncClient(config=config, field_manager=_FIELD_MANAGER)
        return cls(
            client,
            watch_timeout=watch_timeout,
            read_timeout=read_timeout,
            bookmark_period=bookmark_period,
        )

    async def read_claim(self, namespace: str, name: str) -> ResourceClaim:
        return await self._call(
            "get", KubeClaim, "ResourceClaim", claim_from_kube, name=name, namespace=namespace
        )

    async def list_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
        def slices(listed: Any) -> list[ResourceSlice]:
            return sorted((slice_from_kube(s) for s in listed.items), key=lambda s: s.name)

        return await self._call(
            "list",
            KubeSlice,
            "ResourceSliceList",
            slices,
            model=_SliceList,
            params={"fieldSelector": f"{_NODE_FIELD}={node_name},{_DRIVER_FIELD}={driver}"},
        )

    async def create_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        return await self._call(
            "post", KubeSlice, "ResourceSlice", slice_from_kube, obj=slice_to_kube(resource_slice)
        )

    async def update_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        return await self._call(
            "put", KubeSlice, "ResourceSlice", slice_from_kube, obj=slice_to_kube(resource_slice)
        )

    async def delete_slice(self, name: str) -> None:
        await self._call("delete", KubeSlice, None, _ignored, name=name)

    async def _call(
        self,
        method: str,
        res: type[Any],
        kind: str | None,
        convert: Callable[[Any], T],
        *,
        model: type[Any] | None = None,
        **request: Any,
    ) -> T:
        """One request, built by lightkube; its answer decoded as a ``kind`` (None: a write
        whose answer is not used, any success) and converted, or a ``KubeApiError``."""
        generic: Any = self._client._client  # lightkube's GenericAsyncClient
        prepared = generic.prepare_request(method, res=res, **request)
        with _errors():
            response = await generic.send(generic.build_adapter_request(prepared), stream=True)
            try:
                body = await _body(response)
            finally:
                await response.aclose()
        status, content_type = response.status_code, response.headers.get("content-type", "")
        if kind is None:
            if not 200 <= status < 300:
                raise _answer.refusal(status, content_type, body)
            return convert(None)
        return _answer.decode(
            status, content_type, body, model=model or res, kind=kind, convert=convert
        )

    async def watch_slices(
        self, driver: str, node_name: str, resource_version: str = ""
    ) -> AsyncIterator[SliceEvent | None]:
        # One watch request, not lightkube's watch(), which opens the next one at once, forever,
        # whenever the server ends one (621-785 requests/s behind a proxy that ends them at
        # once): the caller backs off and watches again, from the last version it saw. Its
        # pieces are lightkube's.
        seconds = max(1, round(self._watch_timeout * (1 + random.random())))
        read = self._read_timeout
        if read is None:
            read = min(seconds + _READ_GRACE, 2 * self._bookmark_period)
        generic: Any = self._client._client  # lightkube's GenericAsyncClient
        params: dict[str, Any] = {
            "timeoutSeconds": seconds,
            "fieldSelector": f"{_NODE_FIELD}={node_name},{_DRIVER_FIELD}={driver}",
            # Bookmarks carry the version a quiet watch has reached, so that the next one
            # resumes from there rather than from a version the server may have compacted.
            "allowWatchBookmarks": "true",
        }
        if resource_version:
            params["resourceVersion"] = resource_version
        request = generic.prepare_request("list", res=KubeSlice, watch=True, params=params)
        request.timeout = httpx2.Timeout(_CONNECT_TIMEOUT, read=read)
        with _errors():
            response = await generic.send(generic.build_adapter_request(request), stream=True)
            try:
                if not 200 <= response.status_code < 300:
                    body = await _body(response)
                    content_type = response.headers.get("content-type", "")
                    raise _answer.refusal(response.status_code, content_type, body)
                async for line in response.aiter_lines():
                    if line.strip():
                        yield _event(line)
            except httpx2.ReadTimeout as exc:
                raise KubeApiError(
                    0,
                    f"the watch sent neither an event nor a bookmark for {read:g}s: abandoned "
                    "as a dead connection",
                ) from exc
            finally:
                await response.aclose()

    async def node_uid(self, node_name: str) -> str:
        def uid(node: Any) -> str:
            return str(node.metadata.uid or "")

        return await self._call("get", Node, "Node", uid, name=node_name)

    async def apply_claim_status(
        self, claim: ResourceClaim, field_manager: str, devices: Sequence[ClaimDeviceStatus]
    ) -> None:
        await self._call(
            "patch",
            KubeClaim.Status,
            None,
            _ignored,
            name=claim.name,
            namespace=claim.namespace,
            obj=claim_status_apply(claim, devices),
            headers={"Content-Type": PatchType.APPLY.value},
            params={"force": "true", "fieldManager": field_manager},
        )

    async def create_event(self, event: NodeEvent) -> None:
        await self._call("post", KubeEvent, None, _ignored, obj=event_to_kube(event))

    async def aclose(self) -> None:
        await self._client.close()


class _SliceList(msgspec.Struct):
    """A ResourceSliceList answer: its items, decoded as lightkube's models."""

    items: list[KubeSlice]
    kind: str | None = None


def _ignored(_: Any) -> None:
    return None


async def _body(response: httpx2.Response) -> bytes:
    """The answer's body, at most ``_answer.MAX_ANSWER_BYTES``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > _answer.MAX_ANSWER_BYTES:
            raise KubeApiError(
                response.status_code,
                f"the answer is longer than {_answer.MAX_ANSWER_BYTES} bytes",
                malformed=True,
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _event(line: str) -> SliceEvent | None:
    """One line of a watch: its event; the ``Status`` of an ERROR event raised (410 Gone: the
    version is too old); None for an event that cannot be read as a slice (the caller lists)."""
    kind, obj = _answer.watch_event(line)
    meta = obj.get("metadata")
    version = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
    if kind == "BOOKMARK":
        return SliceEvent("BOOKMARK", None, version) if version else None
    if kind not in ("ADDED", "MODIFIED", "DELETED"):
        return None
    try:
        resource_slice = slice_from_kube(KubeSlice.from_dict(obj))
    except Exception:  # a slice we cannot read is a change we cannot see: the caller lists
        return None
    return SliceEvent(
        cast("Literal['ADDED', 'MODIFIED', 'DELETED']", kind), resource_slice, version
    )


class _errors:
    """Turns httpx's errors (the API server not reached, the connection broken) into
    ``KubeApiError`` 0; what the server answered is ``_answer``'s."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if isinstance(exc, httpx2.HTTPError):
            raise KubeApiError(0, printable(f"{type(exc).__name__}: {exc}")[:300]) from exc
        return False


# ------------------------------------------------------------------ conversions


def _attribute_to_kube(value: AttributeValue) -> m.DeviceAttribute:
    if isinstance(value, bool):
        return m.DeviceAttribute(bool=value)
    if isinstance(value, int):
        return m.DeviceAttribute(int=value)
    if isinstance(value, Version):
        return m.DeviceAttribute(version=value.text)
    return m.DeviceAttribute(string=value)


def _field(obj: Any, name: str) -> Any:
    # lightkube decodes nested models lazily: a map's values may still be plain dicts.
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _attribute_from_kube(attribute: Any) -> AttributeValue | None:
    if _field(attribute, "bool") is not None:
        return bool(_field(attribute, "bool"))
    if _field(attribute, "int") is not None:
        return int(_field(attribute, "int"))
    if _field(attribute, "version") is not None:
        return Version(_field(attribute, "version"))
    if _field(attribute, "string") is not None:
        return str(_field(attribute, "string"))
    return None  # a list-valued attribute (alpha): not one this SDK writes


def slice_to_kube(s: ResourceSlice) -> KubeSlice:
    """The lightkube object of a slice."""
    owners = (
        [
            meta_v1.OwnerReference(
                apiVersion="v1", kind="Node", name=s.node_name, uid=s.node_uid, controller=True
            )
        ]
        if s.node_uid
        else None
    )
    metadata = meta_v1.ObjectMeta(
        name=s.name or None,
        # The name kubeletplugin's ResourceSlice controller generates: <node>-<driver>-xxxxx.
        generateName=None if s.name else f"{s.node_name}-{s.driver}-",
        resourceVersion=s.resource_version or None,
        ownerReferences=owners,
    )
    devices = [_device_to_kube(d) for d in s.devices]
    spec = m.ResourceSliceSpec(
        driver=s.driver,
        pool=m.ResourcePool(name=s.pool, generation=s.generation, resourceSliceCount=s.slice_count),
        nodeName=s.node_name,
        # Since 1.35 a slice sets one of devices and sharedCounters, never both.
        devices=devices or (None if s.shared_counters else []),
        sharedCounters=[
            m.CounterSet(
                name=c.name, counters={k: m.Counter(value=str(q)) for k, q in c.counters.items()}
            )
            for c in s.shared_counters
        ]
        or None,
    )
    return KubeSlice(metadata=metadata, spec=spec)


def _device_to_kube(d: SliceDevice) -> m.Device:
    """The lightkube object of one published device."""
    return m.Device(
        name=d.name,
        attributes={k: _attribute_to_kube(v) for k, v in d.attributes.items()} or None,
        capacity={
            k: m.DeviceCapacity(
                value=str(q), requestPolicy=_policy_to_kube(d.request_policies.get(k))
            )
            for k, q in d.capacity.items()
        }
        or None,
        allowMultipleAllocations=d.allow_multiple_allocations or None,
        consumesCounters=[
            m.DeviceCounterConsumption(
                counterSet=c.counter_set,
                counters={k: m.Counter(value=str(q)) for k, q in c.counters.items()},
            )
            for c in d.consumes_counters
        ]
        or None,
        taints=[
            m.DeviceTaint(key=t.key, value=t.value or None, effect=t.effect, timeAdded=t.time_added)
            for t in d.taints
        ]
        or None,
    )


def _policy_to_kube(policy: RequestPolicy | None) -> m.CapacityRequestPolicy | None:
    if policy is None:
        return None
    valid_range = None
    if policy.minimum is not None:
        valid_range = m.CapacityRequestPolicyRange(
            min=str(policy.minimum),
            max=str(policy.maximum) if policy.maximum is not None else None,
            step=str(policy.step) if policy.step is not None else None,
        )
    return m.CapacityRequestPolicy(
        default=str(policy.default),
        validValues=[str(v) for v in policy.valid_values] or None,
        validRange=valid_range,
    )


def _policy_from_kube(raw: Any) -> RequestPolicy | None:
    if raw is None:
        return None
    valid_range = _field(raw, "validRange")

    def quantity(value: Any) -> Quantity | None:
        return None if value is None else _quantity(str(value))

    return RequestPolicy(
        default=_quantity(str(_field(raw, "default") or "0")),
        valid_values=tuple(_quantity(str(v)) for v in _field(raw, "validValues") or []),
        minimum=quantity(_field(valid_range, "min")) if valid_range is not None else None,
        maximum=quantity(_field(valid_range, "max")) if valid_range is not None else None,
        step=quantity(_field(valid_range, "step")) if valid_range is not None else None,
    )


def _counters_from_kube(raw: Any) -> dict[str, Quantity]:
    return {
        key: _quantity(str(_field(counter, "value")))
        for key, counter in (raw or {}).items()
        if _field(counter, "value") is not None
    }


def slice_from_kube(obj: Any) -> ResourceSlice:
    """The SDK dataclass of a lightkube ResourceSlice."""
    meta = obj.metadata
    spec = obj.spec
    node_uid = ""
    for owner in (meta.ownerReferences or []) if meta is not None else []:
        if owner.kind == "Node":
            node_uid = owner.uid
    devices = []
    for d in spec.devices or []:
        attributes = {}
        for key, raw in (d.attributes or {}).items():
            value = _attribute_from_kube(raw)
            if value is not None:
                attributes[key] = value
        capacity = {
            key: _quantity(str(_field(raw, "value")))
            for key, raw in (d.capacity or {}).items()
            if _field(raw, "value")
        }
        taints = tuple(_taint_from_kube(raw) for raw in (getattr(d, "taints", None) or []))
        policies = {
            key: policy
            for key, raw in (d.capacity or {}).items()
            if (policy := _policy_from_kube(_field(raw, "requestPolicy"))) is not None
        }
        consumes = tuple(
            CounterConsumption(
                str(_field(c, "counterSet")), _counters_from_kube(_field(c, "counters"))
            )
            for c in (d.consumesCounters or [])
        )
        devices.append(
            SliceDevice(
                d.name,
                attributes,
                capacity,
                taints,
                allow_multiple_allocations=bool(d.allowMultipleAllocations),
                request_policies=policies,
                consumes_counters=consumes,
            )
        )
    return ResourceSlice(
        name=meta.name or "",
        driver=spec.driver,
        node_name=spec.nodeName or "",
        pool=spec.pool.name,
        generation=int(spec.pool.generation),
        slice_count=int(spec.pool.resourceSliceCount),
        devices=tuple(devices),
        resource_version=meta.resourceVersion or "",
        node_uid=node_uid,
        shared_counters=tuple(
            CounterSet(str(_field(c, "name")), _counters_from_kube(_field(c, "counters")))
            for c in (spec.sharedCounters or [])
        ),
    )


def _taint_from_kube(raw: Any) -> DeviceTaint:
    added = _field(raw, "timeAdded")
    if isinstance(added, str):  # a map's values may still be plain dicts (see _field)
        added = datetime.datetime.fromisoformat(added.replace("Z", "+00:00"))
    effect: TaintEffect = _field(raw, "effect")
    return DeviceTaint(_field(raw, "key"), _field(raw, "value") or "", effect, added)


def _quantity(text: str) -> Quantity:
    try:
        return Quantity.parse(text)
    except ValueError:
        return Quantity(0)  # not a quantity, or past 2**63-1: no capacity we could offer


def claim_from_kube(obj: Any) -> ResourceClaim:
    """The SDK dataclass of a lightkube ResourceClaim."""
    meta = obj.metadata
    status = obj.status
    allocation = status.allocation if status is not None else None
    results: list[AllocatedDevice] = []
    if allocation is not None and allocation.devices is not None:
        results = [
            AllocatedDevice(
                r.request,
                r.driver,
                r.pool,
                r.device,
                share_id=r.shareID or "",
                # Any valid spelling (12e9, 500m, 1.5Gi); one that is none fails the read.
                consumed={
                    key: Quantity.parse(str(value))
                    for key, value in (r.consumedCapacity or {}).items()
                },
                admin_access=bool(r.adminAccess),
            )
            for r in allocation.devices.results or []
        ]
    reserved = tuple(r.uid for r in (status.reservedFor or [])) if status is not None else ()
    config: tuple[DeviceConfig, ...] = ()
    if allocation is not None and allocation.devices is not None:
        config = tuple(_config_from_kube(c) for c in allocation.devices.config or [])
    annotations = (meta.annotations or {}) if meta is not None else {}
    return ResourceClaim(
        namespace=meta.namespace or "",
        name=meta.name or "",
        uid=meta.uid or "",
        allocated=allocation is not None,
        results=tuple(results),
        reserved_for=reserved,
        config=config,
        pod_claim_name=annotations.get(POD_CLAIM_NAME),
    )


def _config_from_kube(raw: Any) -> DeviceConfig:
    """One ``status.allocation.devices.config`` entry; a non-opaque one (a future kind of
    configuration) keeps an empty driver, so no driver takes it for its own."""
    opaque = raw.opaque
    return DeviceConfig(
        source="FromClass" if raw.source == "FromClass" else "FromClaim",
        requests=tuple(raw.requests or ()),
        driver=opaque.driver if opaque is not None else "",
        parameters=opaque.parameters if opaque is not None else None,
    )


def claim_status_apply(
    claim: ResourceClaim, devices: Sequence[ClaimDeviceStatus]
) -> dict[str, Any]:
    """The apply configuration of a claim's ``status.devices[]`` entries (a merge by driver,
    pool and device, so each field manager owns its own entries; the UID a precondition)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
        "status": {"devices": [device_status_to_kube(d) for d in devices]},
    }


def device_status_to_kube(entry: ClaimDeviceStatus) -> dict[str, Any]:
    """One ``status.devices[]`` entry as JSON."""
    out: dict[str, Any] = {"driver": entry.driver, "pool": entry.pool, "device": entry.device}
    status = entry.status
    if status.conditions:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        out["conditions"] = [
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": now,
            }
            for c in status.conditions
        ]
    if status.data is not None:
        out["data"] = dict(status.data)
    net = status.network_data
    if net is not None:
        data: dict[str, Any] = {}
        if net.interface_name:
            data["interfaceName"] = net.interface_name
        if net.ips:
            data["ips"] = list(net.ips)
        if net.hardware_address:
            data["hardwareAddress"] = net.hardware_address
        out["networkData"] = data
    return out


def event_to_kube(event: NodeEvent) -> KubeEvent:
    """The core/v1 Event of a Node event (named as client-go's recorder names them)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return KubeEvent(
        metadata=meta_v1.ObjectMeta(
            name=f"{event.node_name}.{random.getrandbits(64):016x}",
            namespace=EVENT_NAMESPACE,
        ),
        involvedObject=core_v1.ObjectReference(
            apiVersion="v1", kind="Node", name=event.node_name, uid=event.node_uid or None
        ),
        reason=event.reason,
        message=event.message[:1024],
        type=event.type,
        source=core_v1.EventSource(component=event.component or None, host=event.node_name),
        firstTimestamp=now,
        lastTimestamp=now,
        count=1,
        reportingComponent=event.component or None,
        reportingInstance=event.node_name,
    )
