"""An RDMA device plugin for MPI and NCCL jobs: the built-in RDMA backend plus HCA variables.

The backend finds InfiniBand HCAs, RoCE NICs and their SR-IOV VFs, serves one resource per
entry of ``resources`` (whole devices or shares of them) and keeps their health current from
port state; this subclass adds the variables MPI and NCCL jobs want: the HCAs and ports the
container got. ``RdmaPlugin.from_config`` makes one plugin of this class per resource. Run it
with ``devplugin run plugin:RdmaExamplePlugin --config config.yaml`` (see README.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from devplugin_sdk import Allocation, Device
from devplugin_sdk.backends.rdma import RdmaPlugin


class RdmaExamplePlugin(RdmaPlugin):
    """``RdmaPlugin`` that also sets ``NCCL_IB_HCA`` and ``UCX_NET_DEVICES``.

    Its ``from_config`` classmethod (inherited) takes the keys of ``config.yaml`` and returns
    one ``RdmaExamplePlugin`` per resource.
    """

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """The backend's nodes and ``RDMA_DEVICES``/``RDMA_NETDEVS``, plus the HCA lists in the
        forms NCCL (``=mlx5_0:1,mlx5_1:1``, ``=`` for exact names) and UCX (``mlx5_0:1,...``)
        take."""
        allocation = await super().allocate(devices)
        ports: dict[str, None] = {}
        for device in devices:
            name = device.text("rdmaDevice")
            for port in device.text("ports").split(","):
                ports.setdefault(f"{name}:{port}")
        env = {
            **allocation.env,
            "NCCL_IB_HCA": "=" + ",".join(ports),
            "UCX_NET_DEVICES": ",".join(ports),
        }
        return dataclasses.replace(allocation, env=env)
