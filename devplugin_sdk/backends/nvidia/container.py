"""What a container gets for its GPUs: the GPU list in the configured form(s) (an environment
variable, ``/dev/null`` mounts, CDI names) and the devices' nodes.

Device-list strategies as NVIDIA/k8s-device-plugin ``internal/plugin/server.go`` has them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from devplugin_sdk.backends.nvidia.config import Interceptor, NvidiaConfig
from devplugin_sdk.types import Allocation, Device, Mount

__all__ = ["VISIBLE_DEVICES_ENV", "container_setup"]

# NVIDIA's container runtime reads the GPUs to inject from this variable.
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# volume-mounts strategy (k8s-device-plugin internal/plugin/server.go): one /dev/null bind
# mount per device under this directory, and the variable points at the directory.
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"


def container_setup(
    config: NvidiaConfig, uuids: Sequence[str], devices: Sequence[Device]
) -> Allocation:
    """The GPUs ``uuids`` in the configured form(s), and the nodes of ``devices``."""
    cfg = config
    merged = Allocation.merge(devices) if cfg.pass_device_specs else Allocation()
    env = dict(merged.env)
    mounts = list(merged.mounts)
    cdi = list(merged.cdi_devices)
    if "envvar" in cfg.device_list_strategy:
        env[VISIBLE_DEVICES_ENV] = ",".join(uuids)
    if "volume-mounts" in cfg.device_list_strategy:
        env[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_ROOT
        mounts += [Mount("/dev/null", f"{VOLUME_MOUNTS_ROOT}/{u}") for u in uuids]
    if "cdi" in cfg.device_list_strategy:
        cdi += [f"{cfg.cdi_kind}={u}" for u in uuids]
    return Allocation(
        device_nodes=merged.device_nodes,
        mounts=tuple(mounts),
        env=env,
        annotations=merged.annotations,
        cdi_devices=tuple(dict.fromkeys(cdi)),
    )


def _with_limits(
    allocation: Allocation, env: Mapping[str, str], interceptor: Interceptor | None
) -> Allocation:
    mounts = allocation.mounts + (interceptor.mounts() if interceptor is not None else ())
    return replace(allocation, env=dict(env), mounts=mounts)
