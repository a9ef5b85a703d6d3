"""An RDMA device's health: its ports' state and physical state, and the /dev/infiniband nodes a
container needs (``evaluate_health``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from devplugin_sdk.backends.rdma.discovery import _DEV_SUBDIR, _HOST_DEV, RdmaDeviceInfo
from devplugin_sdk.types import (
    Health,
)

__all__ = ["evaluate_health"]


def evaluate_health(
    device: RdmaDeviceInfo,
    *,
    ports: Sequence[int] = (),
    dev_root: Path = Path("/dev"),
    require_rdma_cm: bool = True,
) -> tuple[Health, str]:
    """Decide a device's health; blocking (checks ``/dev`` nodes).

    Healthy means: its uverbs node exists (without it no verbs application can open the
    device), ``rdma_cm`` exists when required, and every considered port is ACTIVE with
    physical state LinkUp. A multi-port device is Healthy only if all considered ports are up,
    because the container gets the whole device and cannot choose a port.

    Args:
        device: The device, as ``scan`` returned it.
        ports: Port numbers to consider; empty means every port.
        dev_root: Where the ``infiniband`` node directory is looked up.
        require_rdma_cm: Treat a missing ``/dev/infiniband/rdma_cm`` as unhealthy.

    Returns:
        The health and, when unhealthy, why.
    """
    problems: list[str] = []
    nodes = Path(dev_root) / _DEV_SUBDIR
    if device.uverbs is None:
        problems.append("no uverbs device in sysfs (is ib_uverbs loaded?)")
    elif not (nodes / device.uverbs).exists():
        problems.append(f"{_HOST_DEV / device.uverbs} is missing")
    if require_rdma_cm and not (nodes / "rdma_cm").exists():
        problems.append(f"{_HOST_DEV / 'rdma_cm'} is missing (is rdma_ucm loaded?)")
    by_number = {port.number: port for port in device.ports}
    wanted = list(ports) or sorted(by_number)
    if not wanted:
        problems.append("no ports")
    for number in wanted:
        port = by_number.get(number)
        if port is None:
            problems.append(f"port {number} does not exist")
        elif not port.active:
            problems.append(f"port {number} is {port.state_name}/{port.phys_state_name}")
    if problems:
        return Health.UNHEALTHY, f"{device.name}: " + "; ".join(problems)
    return Health.HEALTHY, ""
