"""The DeviceClasses of a DRA driver's resources: the bridge from device-plugin resource names.

One class per resource the runner serves: its selector is the driver, and, when the driver
serves several resources in one pool, the ``resourceName`` attribute the driver then publishes
on each device (``tag``). With ``extended``, each class also names the device-plugin resource
as its ``extendedResourceName`` (KEP-5004, GA in Kubernetes 1.37): pods that ask for
``nvidia.com/gpu: 1`` are then served by DRA. ``devplugin dra deviceclass`` prints them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from devplugin_sdk.types import MAX_ATTRIBUTE_VALUE_BYTES, MAX_ATTRIBUTES_AND_CAPACITIES, Quantity

__all__ = ["RESOURCE_ATTRIBUTE", "class_name", "device_classes", "tag"]

#: The attribute (in the driver's domain) naming a device's device-plugin resource, published
#: when the driver serves several resources.
RESOURCE_ATTRIBUTE = "resourceName"
_NOT_IN_NAME = re.compile(r"[^a-z0-9-]+")


def tag(
    attributes: Mapping[str, Any],
    capacity: Mapping[str, Quantity],
    resource: str,
    *,
    several: bool,
) -> Mapping[str, Any]:
    """``attributes`` with ``resourceName`` when the pool holds several resources (and the
    device has room for it, and does not use the name itself)."""
    if (
        not several
        or RESOURCE_ATTRIBUTE in attributes
        or len(attributes) + len(capacity) >= MAX_ATTRIBUTES_AND_CAPACITIES
        or len(resource.encode()) > MAX_ATTRIBUTE_VALUE_BYTES
    ):
        return attributes
    return {**attributes, RESOURCE_ATTRIBUTE: resource}


def class_name(driver: str, resource: str, *, several: bool) -> str:
    """The class of ``resource``: the driver's name, or ``<resource's name>.<driver>`` when
    the driver serves several resources."""
    if not several:
        return driver
    label = _NOT_IN_NAME.sub("-", resource.rsplit("/", 1)[-1].lower()).strip("-")[:63]
    return f"{label or 'resource'}.{driver}"


def device_classes(
    driver: str, resources: Sequence[str], *, extended: bool = False
) -> list[dict[str, Any]]:
    """The DeviceClass objects (resource.k8s.io/v1) of ``resources`` served by ``driver``."""
    several = len(resources) > 1
    out = []
    for resource in resources:
        expression = f'device.driver == "{driver}"'
        if several:
            attribute = f'device.attributes["{driver}"]'
            expression += (
                f' && "{RESOURCE_ATTRIBUTE}" in {attribute}'
                f' && {attribute}.{RESOURCE_ATTRIBUTE} == "{resource}"'
            )
        spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
        if extended:
            spec["extendedResourceName"] = resource
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": class_name(driver, resource, several=several)},
                "spec": spec,
            }
        )
    return out
