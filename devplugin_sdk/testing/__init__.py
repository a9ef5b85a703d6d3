"""Test tools for plugin authors: ``FakeKubelet``, ``serving``, ``StaticPlugin`` and, for DRA,
``MemoryApi`` (ResourceClaims and ResourceSlices in memory) with ``FakeKubelet.dra``.

``FakeKubelet`` plays the kubelet over real gRPC on real unix sockets; ``serving`` runs plugins
against it in the background of a test, through the one runner (``devplugin_sdk.serve``)::

    async with FakeKubelet() as kubelet, serving(MyPlugin(), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("acme.com/widget", 4)
        got = await kubelet.allocate("acme.com/widget", 1)

``DraNode`` is the same for a DRA driver: the fake kubelet's DRA side, ``MemoryApi`` and the
plugins served as the driver, ready when entered (``published()``, ``claim()``, ``prepare()``,
``spec()``); ``DaemonSetPod`` is one instance of a DaemonSet's pod, for rolling upgrades::

    async with DraNode(MyPlugin(), driver="widget.acme.com") as node:
        pod = node.pod("gpus")
        claim = node.claim("gpus", {"widgets": ["w0"]}, pods=[pod])
        await node.prepare(pod)
        edits = node.spec(claim).devices[0]["containerEdits"]

``watching`` runs a plugin's ``watch()`` alone, as the SDK runs it, for tests of pushed health::

    async with watching(plugin) as events:
        assert await events.next_event() == HealthEvent("dev0", Health.UNHEALTHY, "gone")
"""

from __future__ import annotations

from devplugin_sdk.kubelet.fake import (
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    FakeKubelet,
    FakeKubeletError,
    KubeletDevice,
    Registration,
)
from devplugin_sdk.kubelet.fake_dra import DraPod, PodPreparationError, PreparedPod
from devplugin_sdk.kubelet.memory_api import MemoryApi
from devplugin_sdk.testing._daemonset import DaemonSetPod
from devplugin_sdk.testing._dra_node import ClaimSpec, DraNode
from devplugin_sdk.testing._serving import serving
from devplugin_sdk.testing._static import StaticPlugin
from devplugin_sdk.testing._watching import WatchedEvents, watching

__all__ = [
    "AdmissionError",
    "ClaimSpec",
    "ContainerAllocation",
    "ContainerStartError",
    "DaemonSetPod",
    "DraNode",
    "DraPod",
    "FakeKubelet",
    "FakeKubeletError",
    "KubeletDevice",
    "MemoryApi",
    "PodPreparationError",
    "PreparedPod",
    "Registration",
    "StaticPlugin",
    "WatchedEvents",
    "serving",
    "watching",
]
