"""Rolling upgrades (a DaemonSet with ``maxSurge: 1, maxUnavailable: 0``) of both APIs.

The next pod's instance starts beside the running one, with its pod UID in its socket names,
registers, and then the old one gets SIGTERM (leaves ``serving``). Admissions (device plugin:
Allocate through FakeKubelet) and prepares (DRA: the fake kubelet's DRA manager) keep coming the
whole time; none may fail on the newest kubelet behaviour. On the older device manager (v1.32 to
v1.36, kubelet issue #121994) the old stream's end tears down the new registration: the new
instance must register again by itself, without waiting for its stream-lost grace.
``benchmarks/bench_upgrade.py`` runs 100 of each and prints the figures.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Settings, SocketInUseError
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.runner import Running
from devplugin_sdk.testing import (
    AdmissionError,
    DaemonSetPod,
    DraNode,
    FakeKubelet,
    StaticPlugin,
    serving,
)

UPGRADES = 5


class _Load:
    """A steady stream of admissions: how many went through, and the failures."""

    def __init__(self, admit: Callable[[int], Awaitable[None]]) -> None:
        self.admit = admit
        self.done = 0
        self.failures: list[str] = []

    async def run(self) -> None:
        while True:
            try:
                await self.admit(self.done + len(self.failures))
            except (AdmissionError, PodPreparationError) as exc:
                self.failures.append(str(exc))
            else:
                self.done += 1
            await anyio.lowlevel.checkpoint()

    async def more(self, kubelet: FakeKubelet, count: int = 5) -> None:
        """Wait until ``count`` more admissions have gone through."""
        target = self.done + count
        await kubelet.wait_for(lambda: self.done >= target, what=f"{count} more admissions")


def _ready(running: Running) -> bool:
    """The pod's readiness probe (/healthz): every plugin registered, its stream open."""
    return all(status.registered for status in running.statuses())


async def _upgrade_device_plugin(kubelet: FakeKubelet, **settings: Any) -> _Load:
    async def admit(_n: int) -> None:
        kubelet.release(await kubelet.allocate(RESOURCE, 1))

    load = _Load(admit)
    async with anyio.create_task_group() as tg:
        old = DaemonSetPod(
            StaticPlugin(RESOURCE, widgets(4)), settings=kubelet.settings(**settings)
        )
        await old.start(tg)
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        tg.start_soon(load.run)
        for _upgrade in range(UPGRADES):
            new = DaemonSetPod(
                StaticPlugin(RESOURCE, widgets(4)), settings=kubelet.settings(**settings)
            )
            running = await new.start(tg)
            # The DaemonSet stops the old pod once the new one is Ready (/healthz: registered).
            await kubelet.wait_for(partial(_ready, running), what="the new pod Ready")
            await load.more(kubelet)
            await old.stop()  # SIGTERM to the old pod
            old = new
            await load.more(kubelet)
            assert kubelet.is_registered(RESOURCE)
            assert kubelet.allocatable(RESOURCE) == 4
            assert kubelet.connections(RESOURCE) == 1  # the old one's gone, the new one's kept
        tg.cancel_scope.cancel()
    return load


async def test_device_plugin_upgrades_lose_no_admission() -> None:
    """Five upgrades on the newest kubelet (v1.37 device manager): the new instance serves a
    socket of its own name and registers beside the old one, whose stop takes nothing of it."""
    async with FakeKubelet() as kubelet:
        load = await _upgrade_device_plugin(kubelet)
    assert load.failures == []
    assert load.done > 0
    sockets = {r.endpoint for r in kubelet.successful_registrations(RESOURCE)}
    assert len(sockets) == UPGRADES + 1  # one socket name per pod
    assert all(RESOURCE.replace("/", "_") in name for name in sockets)


async def test_on_an_older_kubelet_the_new_instance_registers_again_at_once() -> None:
    """v1.32 to v1.36 (#121994): the old stream's end disconnects the new registration; the new
    instance registers again by itself, long before its stream-lost grace (30 s here)."""
    async with FakeKubelet(per_socket_clients=False) as kubelet:
        with anyio.fail_after(20):
            load = await _upgrade_device_plugin(kubelet, stream_lost_grace=30.0)
        # Each upgrade costs the new instance one registration: its first and its second.
        assert len(kubelet.successful_registrations(RESOURCE)) >= 1 + 2 * UPGRADES
    # Failures happen only in the window between the teardown and the new registration (the
    # devices unhealthy, or an Allocate cut off with the connection); bench_upgrade.py times it.
    kinds = ("cannot allocate unhealthy devices", "code = Cancelled", "unregistered device")
    assert all(any(k in f for k in kinds) for f in load.failures), load.failures[:3]


@pytest.mark.parametrize("per_socket_clients", [True, False], ids=["v1.37", "v1.32"])
async def test_upgrades_through_the_plugin_watcher(per_socket_clients: bool) -> None:
    """The same through plugins_registry: on the newest kubelet nothing fails; on the older one
    the new instance serves a fresh socket at once (the kubelet's reconciler then registers it,
    within its 1 s period on a real kubelet)."""
    async with FakeKubelet(plugin_watcher=True, per_socket_clients=per_socket_clients) as kubelet:
        with anyio.fail_after(20):
            load = await _upgrade_device_plugin(kubelet, stream_lost_grace=30.0)
    if per_socket_clients:
        assert load.failures == []
    assert load.done > 0


async def test_a_second_instance_of_the_same_pod_harms_nothing() -> None:
    """Same pod UID, same socket names: the second one refuses, the first keeps serving."""
    async with FakeKubelet() as kubelet, anyio.create_task_group() as tg:
        first = DaemonSetPod(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings())
        await first.start(tg)
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        with pytest.raises(SocketInUseError, match="another live process"):
            async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=first.settings):
                await anyio.sleep_forever()
        assert kubelet.is_registered(RESOURCE)
        await kubelet.allocate(RESOURCE, 1)
        await first.stop()


def test_a_bad_pod_uid_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"Settings.pod_uid 'a/b': must be a pod UID"):
        Settings(pod_uid="a/b")


# ---------------------------------------------------------------------- DRA


def _dra_pod(node: DraNode) -> DaemonSetPod:
    """The next pod of the driver's DaemonSet (a pod UID of its own)."""
    return DaemonSetPod(
        StaticPlugin(RESOURCE, widgets(4)),
        settings=node.kubelet.settings(),
        api="dra",
        dra=node.options,
    )


async def _upgrade_dra(node: DraNode, upgrades: int = UPGRADES) -> _Load:
    kubelet = node.kubelet

    async def prepare(n: int) -> None:
        name = f"claim-{n}"
        pod = node.pod(name, name=f"pod-{n}")
        node.claim(name, {"widgets": [f"w{n % 4}"]}, pods=[pod])
        try:
            prepared = await node.prepare(pod)
            assert prepared.cdi_ids(name)
            await node.unprepare(pod)
        finally:
            node.api.delete_claim("default", name)

    load = _Load(prepare)

    def registered(count: int) -> bool:
        return len(kubelet.dra.successful_registrations(DRIVER)) == count

    async with anyio.create_task_group() as tg:
        old = _dra_pod(node)
        await old.start(tg)
        await node.ready()
        await kubelet.wait_for(partial(registered, 1), what="DRA registration")
        tg.start_soon(load.run)
        for upgrade in range(upgrades):
            new = _dra_pod(node)
            await new.start(tg)
            await kubelet.wait_for(partial(registered, upgrade + 2), what="new instance")
            await load.more(kubelet)
            await old.stop()  # SIGTERM: its sockets go, its slices stay
            old = new
            await load.more(kubelet)
            assert kubelet.dra.is_registered(DRIVER)
            assert node.api.pool_complete(DRIVER, "node-1")
        tg.cancel_scope.cancel()
    return load


async def test_dra_upgrades_lose_no_prepare() -> None:
    """Five upgrades on a 1.33+ kubelet: pod-UID sockets, the file lock, the slices handed over;
    every claim prepared by one instance and unprepared by either is cleaned up."""
    async with DraNode(driver=DRIVER) as node:
        kubelet, options = node.kubelet, node.options
        load = await _upgrade_dra(node)
        assert load.failures == []
        assert load.done > 0
        assert kubelet.dra.prepared_claims() == []
        assert list(options.cdi_dir.glob("*.json")) == []  # every spec went with its claim
        assert (options.resolved_plugin_dir / "serialize.lock").exists()
        endpoints = {r.endpoint for r in kubelet.dra.successful_registrations(DRIVER)}
        assert len(endpoints) == UPGRADES + 1
        assert all("/dra-" in e for e in endpoints)
        # Every instance's stop took its own sockets, and only those.
        assert not [p for p in kubelet.registry_directory.iterdir() if p.name.startswith(DRIVER)]


async def test_dra_claim_prepared_by_one_instance_is_unprepared_by_the_other() -> None:
    """The kubelet may call either instance: the state is the checkpoint on disk, read again
    under the lock when the other instance wrote it."""
    async with DraNode(driver=DRIVER) as node, anyio.create_task_group() as tg:
        kubelet, options, api = node.kubelet, node.options, node.api
        old = _dra_pod(node)
        await old.start(tg)
        await node.ready()
        pod = node.pod("gpus", name="pod-a")
        node.claim("gpus", {"widgets": ["w1"]}, pods=[pod])
        await node.prepare(pod)  # by the old instance
        checkpoint = options.resolved_plugin_dir / "checkpoint.json"
        assert list(json.loads(checkpoint.read_text())["claims"]) == [
            api.claims[("default", "gpus")].uid
        ]
        first = kubelet.dra.endpoint(DRIVER)
        new = _dra_pod(node)
        await new.start(tg)
        await kubelet.wait_for(
            lambda: kubelet.dra.endpoint(DRIVER) not in (first, None),
            what="the new instance connected",
        )
        await node.unprepare(pod)  # by the new one, the most recent connected
        assert list(options.cdi_dir.glob("*.json")) == []
        assert json.loads(checkpoint.read_text())["claims"] == {}
        await old.stop()
        await new.stop()


async def test_dra_on_a_1_32_kubelet_forgets_the_driver_when_the_old_socket_goes() -> None:
    """Why DRA rolling updates need kubelet 1.33+ (as the kubeletplugin helper says): a 1.32
    kubelet forgets the driver by name when the old instance's registration socket goes."""
    old_kubelet = {"dra_plugins_per_driver": False}
    async with (
        DraNode(driver=DRIVER, kubelet_options=old_kubelet) as node,
        anyio.create_task_group() as tg,
    ):
        kubelet = node.kubelet
        old = _dra_pod(node)
        await old.start(tg)
        await node.ready()
        new = _dra_pod(node)
        await new.start(tg)
        await kubelet.wait_for(
            lambda: len(kubelet.dra.successful_registrations(DRIVER)) == 2, what="new one"
        )
        await old.stop()
        await kubelet.wait_for(lambda: not kubelet.dra.is_registered(DRIVER), what="gone")
        await new.stop()


def test_socket_names_carry_the_pod_uid_hashed_to_fit_a_unix_socket() -> None:
    """As the kubeletplugin helper's RollingUpdateRegistrarSocketFile: the UID, else its hash,
    else a hash of driver and UID; every path within the 107 bytes of a unix socket."""
    uid = "0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
    driver = "a-very-long-driver-name.example.com"
    settings = Settings(pod_uid=uid)

    def registration(directory: Path) -> Path:
        return settings.instance_socket(directory, f"{driver}-reg.sock", prefix="dra", key=driver)

    def b64(digest: bytes) -> str:
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    short = Path("/run/registry")
    assert registration(short) == short / f"{driver}-{uid}-reg.sock"
    middle = Path("/var/lib/kubelet/" + "x" * 20)
    uid_hash = b64(hashlib.sha256(uid.encode()).digest()[:8])
    assert registration(middle) == middle / f"{driver}-{uid_hash}-reg.sock"
    long = Path("/var/lib/kubelet/" + "x" * 45)
    both = b64(hashlib.sha256(f"{driver}\0{uid}".encode()).digest()[:16])
    assert registration(long) == long / f"dra-{both}-reg.sock"
    for directory in (short, middle, long):
        assert len(str(registration(directory)).encode()) <= 107
    assert settings.instance_socket(short, "dra.sock") == short / f"dra-{uid}.sock"
    assert Settings(pod_uid="").instance_socket(short, "dra.sock") == short / "dra.sock"
