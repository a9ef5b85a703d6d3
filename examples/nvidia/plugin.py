"""A deployable NVIDIA GPU device plugin: the SDK's NVML backend plus what a site adds on top.

The backend discovers GPUs and MIG devices, pushes Xid health and brings GPUs back once they
probe clean, and places multi-GPU pods on the best-connected GPUs. This subclass adds two things
sites usually want: fixed environment variables for every GPU container, and a last health
check before a container starts, so that a GPU lost since it was advertised never starts a pod.
Run it with ``python plugin.py --config config.yaml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from devplugin_sdk import (
    Allocation,
    AllocationError,
    ConfigError,
    Device,
    Health,
    Settings,
    healthz,
    run,
)
from devplugin_sdk.backends.nvml import NvidiaConfig, NvmlPlugin, build_plugins

log = logging.getLogger("nvidia-plugin")

# Keys of config.yaml that this example reads itself; the rest is the backend's.
EXAMPLE_KEYS = ("containerEnv",)


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

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """The backend's setup (GPU list, device nodes) plus the site variables."""
        allocation = await super().allocate(devices)
        # The backend's NVIDIA_VISIBLE_DEVICES wins over a site variable of the same name.
        env = {**self.container_env, **allocation.env}
        return dataclasses.replace(allocation, env=env)

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        """Refuse to start on a GPU that fails an NVML probe now (the kubelet retries later).

        Raises:
            AllocationError: naming the GPUs that are not healthy.
        """
        health = await self.check_health(devices)
        bad = sorted(
            d.id
            for d in devices
            if Health.UNHEALTHY
            in (health.get(d.id), health.get(d.attributes["uuid"]), health.get(d.parent or ""))
        )
        if bad:
            raise AllocationError(f"GPUs not healthy right now: {', '.join(bad)}")


def load_plugins(path: Path, **overrides: Any) -> list[SiteGpuPlugin]:
    """Read config.yaml and return one plugin per resource (more with ``migStrategy: mixed``).

    Args:
        path: The config file.
        **overrides: ``sysfs_root``/``dev_root``/``proc_root`` replacing the file's, and
            ``nvml``/``clock`` for the plugins (tests pass a fake NVML).

    Raises:
        ConfigError: the file is unreadable or invalid (names the key).
        BackendError: NVML is unusable while listing MIG profiles.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(str(path), "must hold a mapping")
    env = data.get("containerEnv", {})
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ConfigError("containerEnv", "must map variable names to strings")
    backend = {k: v for k, v in data.items() if k not in EXAMPLE_KEYS}
    config = NvidiaConfig.from_mapping(backend)
    config = dataclasses.replace(
        config,
        sysfs_root=Path(overrides.pop("sysfs_root", config.sysfs_root)),
        dev_root=Path(overrides.pop("dev_root", config.dev_root)),
        proc_root=Path(overrides.pop("proc_root", config.proc_root)),
    )
    return build_plugins(config, plugin_class=SiteGpuPlugin, container_env=env, **overrides)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--config``, ``--metrics-port``, ``--log-level``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve /healthz, /metrics and /status on this TCP port (devplugin_sdk.healthz)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the GPU resources until SIGTERM."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        plugins = load_plugins(args.config)
    except ConfigError as exc:
        parser.exit(2, f"bad configuration: {exc}\n")
    for plugin in plugins:
        log.info("serving %s", plugin.resource_name)
    # check_health is polled on this period; watch() probes on its own probeInterval too.
    settings = Settings(health_interval=plugins[0].config.probe_interval)
    if args.metrics_port is None:
        run(*plugins, settings=settings)
    else:
        healthz.run(plugins, port=args.metrics_port, settings=settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
