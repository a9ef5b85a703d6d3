"""One settings dataclass for everything the SDK's lifecycle needs: paths, timings, limits.

Injected into ``serve()``/``run()``; filesystem roots are parameters so that tests point them at
temporary directories. Defaults are what a production node wants.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from devplugin_sdk import _names
from devplugin_sdk._intervals import LOOP_FLOOR
from devplugin_sdk.api import constants

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Lifecycle settings shared by every plugin that one ``serve()`` call runs.

    Args:
        device_plugin_dir: The kubelet's device-plugin directory (holds ``kubelet.sock``).
        register_timeout: Deadline of one Register call, seconds. At least 15 s: the kubelet
            dials back (up to 10 s) inside Register.
        register_backoff_initial: First retry delay after a retryable Register failure.
        register_backoff_max: Cap of the exponential retry delay.
        restart_poll_interval: How often the kubelet-restart watcher re-checks the socket files
            by polling, on top of inotify (or instead of it, where inotify is unavailable).
        stream_lost_grace: After the kubelet cancels every ListAndWatch stream while
            ``kubelet.sock`` stays up, re-register if no new stream arrives within this many
            seconds (covers the kubelet's duplicate-registration bug).
        reregister_delay: When re-registering with a kubelet that did not restart, wait this
            long after stopping the old server, so the old stream's end cannot tear down the
            new registration (kubelet issue #121994).
        health_interval: Period of ``check_health()`` polling, seconds.
        advisory_hold: How long an advisory (``Effect.ADVISORY``: the device works, operators
            should look) stays on a device after its last advisory signal, seconds, unless the
            device's health changes first.
        rescan_interval: Period of rediscovery, seconds: every plugin's ``discover()`` runs
            again this often, so a device that appears or goes after the start is seen (the
            kubelet hears only of a changed list). 0 turns it off. A plugin's own
            ``rescan_interval`` attribute wins.
        prestart_timeout: Bound on ``pre_start_container()``; the kubelet gives up at 30 s.
        hook_timeout: Bound on ``allocate()`` and ``preferred_allocation()``; the kubelet sets
            none, and admission of every pod on the node waits behind a hanging call.
        stop_grace: Seconds the gRPC server gets to finish in-flight calls when stopping.
        stop_timeout: Bound on a plugin's ``on_stop`` cleanup.
        registration: ``"kubelet"`` registers through ``kubelet.sock``; ``"watcher"`` puts the
            socket in ``plugins_registry_dir`` for the kubelet's plugin watcher; ``"auto"``
            picks the watcher when that directory exists (as Mellanox's and the SR-IOV
            plugins do), unless ``device_plugin_dir`` alone was moved from its default: a
            directory given explicitly is where the plugin was told to register, and wins
            over what a kubelet on the machine left behind.
        plugins_registry_dir: The kubelet's plugin-watcher directory (follows --root-dir).
        pod_uid: The UID of the plugin's pod, for rolling upgrades (a DaemonSet's
            ``maxSurge``): every socket then carries it in its name, so that the next pod's
            instance serves and registers beside this one, and a DRA driver's prepares are
            serialized across both by a file lock. None reads ``$POD_UID`` (set it from the
            downward API, ``fieldRef: metadata.uid``); empty, or unset, keeps one fixed
            name per socket.
    """

    device_plugin_dir: Path = Path(constants.DEVICE_PLUGIN_PATH)
    register_timeout: float = 20.0
    register_backoff_initial: float = 0.2
    register_backoff_max: float = 30.0
    restart_poll_interval: float = 2.0
    stream_lost_grace: float = 5.0
    reregister_delay: float = 1.5
    health_interval: float = 10.0
    advisory_hold: float = 3600.0
    rescan_interval: float = 10.0
    prestart_timeout: float = 20.0
    hook_timeout: float = 8.0
    stop_grace: float = 1.0
    stop_timeout: float = 10.0
    registration: Literal["auto", "kubelet", "watcher"] = "auto"
    plugins_registry_dir: Path = Path(constants.PLUGINS_REGISTRY_PATH)
    pod_uid: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_plugin_dir", Path(self.device_plugin_dir))
        object.__setattr__(self, "plugins_registry_dir", Path(self.plugins_registry_dir))
        if self.registration not in ("auto", "kubelet", "watcher"):
            raise ValueError(
                f"Settings.registration must be auto, kubelet or watcher, got {self.registration!r}"
            )
        for name in (
            "register_timeout",
            "register_backoff_initial",
            "register_backoff_max",
            "restart_poll_interval",
            "health_interval",
            "advisory_hold",
            "prestart_timeout",
            "hook_timeout",
            "stop_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"Settings.{name} must be > 0, got {getattr(self, name)}")
        for name in ("stream_lost_grace", "reregister_delay", "stop_grace", "rescan_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"Settings.{name} must be >= 0, got {getattr(self, name)}")
        # The periods of loops: under LOOP_FLOOR each would be a busy loop.
        if 0 < self.rescan_interval < LOOP_FLOOR:
            raise ValueError(
                f"Settings.rescan_interval must be 0 (off) or at least {LOOP_FLOOR} s, got "
                f"{self.rescan_interval}"
            )
        for loop in ("health_interval", "restart_poll_interval"):
            if 0 < getattr(self, loop) < LOOP_FLOOR:
                raise ValueError(
                    f"Settings.{loop} must be at least {LOOP_FLOOR} s, got {getattr(self, loop)}"
                )
        uid = self.instance_uid
        if uid and (problem := _names.pod_uid_problem(uid)) is not None:
            where = "Settings.pod_uid" if self.pod_uid is not None else "$POD_UID"
            raise ValueError(f"{where} {uid!r}: {problem}")
        if self.prestart_timeout >= constants.PRE_START_CONTAINER_TIMEOUT_S:
            raise ValueError("Settings.prestart_timeout must be under the kubelet's 30 s deadline")

    def uses_plugin_watcher(self) -> bool:
        """Whether plugins register through the plugin watcher (resolves ``"auto"``)."""
        return self.registration_choice()[0] == "watcher"

    def registration_choice(self) -> tuple[Literal["kubelet", "watcher"], str]:
        """How plugins register, and why: ``("kubelet" | "watcher", reason)``.

        ``"auto"`` is resolved here, once: an explicit ``device_plugin_dir`` (with the
        plugin-watcher directory left at its default) means ``kubelet.sock`` there, whatever
        exists under /var/lib/kubelet; otherwise the watcher when its directory exists.
        """
        if self.registration != "auto":
            return self.registration, f"registration {self.registration}"
        moved = self.device_plugin_dir != Path(constants.DEVICE_PLUGIN_PATH)
        registry_default = self.plugins_registry_dir == Path(constants.PLUGINS_REGISTRY_PATH)
        if moved and registry_default:
            return "kubelet", "registration auto: the device-plugin directory was given"
        if self.plugins_registry_dir.is_dir():
            return "watcher", f"registration auto: {self.plugins_registry_dir} exists"
        return "kubelet", f"registration auto: no {self.plugins_registry_dir}"

    @property
    def instance_uid(self) -> str:
        """``pod_uid``, or ``$POD_UID``; empty when the plugin runs as the only instance."""
        return self.pod_uid if self.pod_uid is not None else os.environ.get("POD_UID", "")

    def instance_socket(self, directory: Path, name: str, **hashing: str) -> Path:
        """Where this instance serves the socket plainly named ``name`` in ``directory``: that
        name, or with a pod UID, the instance's own (``_names.instance_socket_name``)."""
        uid = self.instance_uid
        if not uid:
            return directory / name
        return directory / _names.instance_socket_name(name, uid, directory, **hashing)

    @property
    def kubelet_socket(self) -> Path:
        """Path of the kubelet's registration socket."""
        return self.device_plugin_dir / constants.KUBELET_SOCKET_NAME
