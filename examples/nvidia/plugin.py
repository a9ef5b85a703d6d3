"""A deployable NVIDIA GPU device plugin: the SDK's NVML backend plus what a site adds on top.

The backend discovers GPUs and MIG devices, pushes Xid health and brings GPUs back once they
probe clean, and places multi-GPU pods on the best-connected GPUs. This subclass adds two things
sites usually want: fixed environment variables for every GPU container (the ``containerEnv``
key), and a last health check before a container starts, so that a GPU lost since it was
advertised never starts a pod. Run it with ``devplugin run plugin:SiteGpuPlugin --config FILE``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import Self

from devplugin_sdk import Allocation, AllocationError, Device, Health
from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.config import ConfigReader


class SiteGpuPlugin(NvmlPlugin):
    """``NvmlPlugin`` with site-wide container variables and a health check before start.

    Args:
        config: Backend settings.
        container_env: Variables every container gets (``CUDA_DEVICE_ORDER`` ...).
        **kwargs: ``NvmlPlugin`` arguments (``nvml``, ``mig_profile``, ``clock`` ...).
    """

    def __init__(
        self,
        config: NvidiaConfig | None = None,
        *,
        container_env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, **kwargs)
        self.container_env = dict(container_env or {})

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> list[Self]:
        """One plugin per resource: the example's ``containerEnv`` plus the backend's keys.

        Raises:
            ConfigError: an invalid key (names it).
            BackendError: NVML is unusable while listing MIG profiles.
        """
        env = ConfigReader(config).string_map("containerEnv")
        backend = NvidiaConfig.from_mapping(config, extra_keys=("containerEnv",))
        return cls.build(backend, container_env=env)

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """The backend's setup (GPU list, device nodes) plus the site variables."""
        allocation = await super().allocate(devices)
        # The backend's NVIDIA_VISIBLE_DEVICES wins over a site variable of the same name.
        env = {**self.container_env, **allocation.env}
        return dataclasses.replace(allocation, env=env)

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        """Refuse to start on a GPU that fails an NVML probe now (the kubelet retries later).

        Raises:
            AllocationError: naming the GPUs (or MIG devices) that are not healthy.
        """
        health = await self.check_health(devices)
        # Memory units are reported by GPU, their parent; other devices by their own ID.
        bad = sorted(
            {
                str(d.attributes.get("uuid", d.id))
                for d in devices
                if Health.UNHEALTHY in (health.get(d.id), health.get(d.parent or d.id))
            }
        )
        if bad:
            raise AllocationError(f"GPUs not healthy right now: {', '.join(bad)}")
