"""A reload that moves the devices, a scrape of many unhealthy devices, a refused DRA start
(issue 25, rows 7, 11 and 13), each against real sockets or a real process.

- Row 7: the quickstart's plugin is served with its config file watched, one device held by a
  container, and ``devRoot`` moved to another directory. The old directory's devices must never
  come back Healthy (the new plugin's health poll must not see them), the free one must leave, and
  the held one must leave once the kubelet's own record says its pod ended.
- Row 11: ``/metrics`` with many Unhealthy devices stays small, with Allocate served beside it.
- Row 13: a second ``devplugin run`` of one DRA driver exits 2 with one line.

Each prints its figures (a line starting with ``figures``; ``pytest -s`` shows them).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import yaml
from dra_helpers import devplugin_process, driver_run_file
from kube_apiserver import FakeApiServer
from prometheus_client import CollectorRegistry
from sdk_helpers import figures

from devplugin_sdk import Device, DeviceNode, DevicePlugin, Health, HealthEvent, RescanEvent
from devplugin_sdk._engine.held import held_devices
from devplugin_sdk.config import ConfigReader
from devplugin_sdk.metrics import MAX_UNHEALTHY_DEVICE_SERIES
from devplugin_sdk.runner import Http, Reload
from devplugin_sdk.testing import DraNode, FakeKubelet, MemoryApi, serving

ACME = "acme.com/widget"


# ----------------------------------------------------------------------------- row 7


class AcmePlugin(DevicePlugin):
    """The quickstart's plugin: every ``acme*`` file under ``dev`` is a device, Healthy while
    its file exists (docs/quickstart.md, "A plugin in 30 lines")."""

    resource_name = ACME

    def __init__(self, dev: Path, polled: dict[Path, int]) -> None:
        super().__init__()
        self.dev = dev
        self._polled = polled  # health polls by directory (private: not in the fingerprint)

    @classmethod
    def from_config(cls, config: Mapping[str, object], polled: dict[Path, int]) -> AcmePlugin:
        ConfigReader(config).known("devRoot")
        return cls(ConfigReader(config).path("devRoot", "/dev"), polled)

    async def discover(self) -> Sequence[Device]:
        return [
            Device(id=p.name, device_nodes=(DeviceNode(str(p)),), env={"ACME_WIDGET": p.name})
            for p in sorted(self.dev.glob("acme*"))
        ]

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        self._polled[self.dev] = self._polled.get(self.dev, 0) + 1
        # As the quickstart writes it: a stat per device, on the loop.
        return {
            d.id: Health.HEALTHY
            if Path(d.device_nodes[0].host_path).exists()  # noqa: ASYNC240
            else Health.UNHEALTHY
            for d in devices
        }


def write_config(path: Path, dev: Path) -> None:
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(yaml.safe_dump({"devRoot": str(dev)}), encoding="utf-8")
    os.replace(staged, path)


async def test_a_reload_that_moves_dev_root_never_makes_the_old_devices_healthy(
    tmp_path: Path,
) -> None:
    old, new = tmp_path / "acme-dev", tmp_path / "acme-dev-2"
    old.mkdir()
    new.mkdir()
    for name in ("acme0", "acme1"):
        (old / name).touch()
    (new / "acme7").touch()
    config = tmp_path / "acme.yaml"
    write_config(config, old)
    polled: dict[Path, int] = {}

    async def load() -> list[DevicePlugin]:
        data = await anyio.to_thread.run_sync(yaml.safe_load, config.read_text())
        return [AcmePlugin.from_config(data, polled)]

    reload = Reload(load, config_path=config, sighup=False)
    async with FakeKubelet() as kubelet:
        settings = kubelet.settings(health_interval=0.02)
        async with serving(*await load(), settings=settings, reload=reload):
            await kubelet.wait_for_allocatable(ACME, 2)
            held = await kubelet.allocate(ACME, 1, pod="holder")
            [held_id] = held.device_ids
            [free_id] = {"acme0", "acme1"} - {held_id}

            write_config(config, new)
            await kubelet.wait_for_health(ACME, "acme7", "Healthy")
            # Many polls of the new plugin: each one used to make the old devices Healthy.
            await kubelet.wait_for(lambda: polled.get(new, 0) >= 20, what="20 health polls")
            listed = kubelet.devices(ACME)
            healthy = sorted(i for i, d in listed.items() if d.health == "Healthy")
            assert healthy == ["acme7"], kubelet.describe()
            assert kubelet.allocatable(ACME) == 1
            # The device no container holds leaves; the held one stays, Unhealthy.
            await kubelet.wait_for(lambda: free_id not in kubelet.devices(ACME), what="free gone")
            assert kubelet.devices(ACME)[held_id].health == "Unhealthy"

            # Its pod ends (the plugin is never told; the kubelet's checkpoint says so).
            released = time.monotonic()
            kubelet.release(held)
            await kubelet.wait_for(lambda: held_id not in kubelet.devices(ACME), what="held gone")
            leave_s = time.monotonic() - released
            assert set(kubelet.devices(ACME)) == {"acme7"}

            got = await kubelet.allocate(ACME, 1, pod="next")
            assert list(got.device_ids) == ["acme7"]
            assert got.allocation.device_nodes[0].host_path == str(new / "acme7")
    figures(
        "row 7",
        polls_after_reload=polled[new],
        old_devices_healthy=0,
        released_device_left_s=leave_s,
    )


class PushingPlugin(DevicePlugin):
    """Devices ``ids`` of one parent ``card``; ``watch`` pushes Healthy about every ID in
    ``told`` and about the parent, over and over (a backend that re-states health)."""

    resource_name = ACME

    def __init__(self, ids: Sequence[str], told: Sequence[str], rounds: list[int]) -> None:
        super().__init__()
        self.ids = list(ids)
        self._told = told
        self._rounds = rounds

    async def discover(self) -> Sequence[Device]:
        return [Device(id=i, parent="card") for i in self.ids]

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        while True:
            for device_id in [*self._told, "card"]:
                yield HealthEvent(device_id, Health.HEALTHY, "re-stated")
            self._rounds.append(len(self.ids))
            await anyio.sleep(0.01)


async def test_pushed_health_about_a_retired_device_or_its_parent_leaves_it_out(
    tmp_path: Path,
) -> None:
    config = tmp_path / "ids.yaml"
    config.write_text("[w0, w1]")
    told = ["w0", "w1", "w2"]
    rounds: list[int] = []

    async def load() -> list[DevicePlugin]:
        ids = await anyio.to_thread.run_sync(yaml.safe_load, config.read_text())
        return [PushingPlugin(ids, told, rounds)]

    reload = Reload(load, config_path=config, sighup=False)
    async with FakeKubelet() as kubelet:
        async with serving(*await load(), settings=kubelet.settings(), reload=reload):
            await kubelet.wait_for_allocatable(ACME, 2)
            held = await kubelet.allocate(ACME, 1, pod="holder")
            [held_id] = held.device_ids
            config.write_text("[w2]")
            await kubelet.wait_for_health(ACME, "w2", "Healthy")
            await kubelet.wait_for(lambda: rounds.count(1) >= 20, what="20 rounds of pushes")
            assert kubelet.devices(ACME)[held_id].health == "Unhealthy"
            assert kubelet.allocatable(ACME) == 1
            kubelet.release(held)
            await kubelet.wait_for(lambda: set(kubelet.devices(ACME)) == {"w2"}, what="w2 only")


# ----------------------------------------------------------------------------- row 11

UNHEALTHY = 20_000


class ManyUnhealthy(DevicePlugin):
    """``UNHEALTHY`` devices that are out, and one that is fine (for Allocate)."""

    resource_name = "example.com/many"

    async def discover(self) -> Sequence[Device]:
        out = [Device(id=f"bad{i}", health=Health.UNHEALTHY) for i in range(UNHEALTHY)]
        return [Device(id="good0"), *out]


def scrape(port: int) -> tuple[bytes, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        return response.read(), time.monotonic() - started
    finally:
        conn.close()


@pytest.mark.timeout(60)  # twenty thousand devices through discovery and ListAndWatch
async def test_metrics_with_many_unhealthy_devices_stay_small_beside_allocate() -> None:
    registry = CollectorRegistry()
    http = Http(port=0, host="127.0.0.1", registry=registry)
    async with FakeKubelet() as kubelet:
        async with serving(ManyUnhealthy(), settings=kubelet.settings(), http=http) as running:
            assert running.http_port is not None
            port = running.http_port
            await kubelet.wait_for_allocatable("example.com/many", 1, timeout=30)
            latencies: list[float] = []
            scrapes: list[tuple[bytes, float]] = []

            async def scraper() -> None:
                for _ in range(5):
                    scrapes.append(await anyio.to_thread.run_sync(scrape, port))

            async with anyio.create_task_group() as tg:
                tg.start_soon(scraper)
                while len(scrapes) < 5:
                    started = time.monotonic()
                    await kubelet.call_allocate("example.com/many", ["good0"])
                    latencies.append(time.monotonic() - started)
    body = scrapes[-1][0].decode()
    per_device = [
        line for line in body.splitlines() if line.startswith("devplugin_device_unhealthy{")
    ]
    assert len(per_device) == MAX_UNHEALTHY_DEVICE_SERIES
    # What the bounded series leave out is still counted.
    assert 'devplugin_devices_unhealthy_unlabelled{resource="example.com/many"} ' in body
    unlabelled = next(
        line
        for line in body.splitlines()
        if line.startswith("devplugin_devices_unhealthy_unlabelled{")
    )
    assert float(unlabelled.split()[-1]) == UNHEALTHY - MAX_UNHEALTHY_DEVICE_SERIES
    biggest = max(len(b) for b, _ in scrapes)
    assert biggest < 256 << 10, biggest  # 1.9 MB before the bound, at 20k devices
    figures(
        "row 11",
        devices_unhealthy=UNHEALTHY,
        metrics_bytes=biggest,
        scrape_s_max=max(s for _, s in scrapes),
        allocate_median_ms=statistics.median(latencies) * 1000,
        allocate_max_ms=max(latencies) * 1000,
        allocates=len(latencies),
    )


# ----------------------------------------------------------------------------- row 13


@pytest.mark.timeout(60)  # two real `devplugin run` processes
@pytest.mark.parametrize("api", ["dra", "both"])
async def test_a_second_dra_instance_exits_2_with_one_line(tmp_path: Path, api: str) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "ttyUSB0").touch()
    memory = MemoryApi(nodes=["node-1"])
    # The driver runs as `devplugin run` processes: the node serves none itself.
    node = DraNode(driver="serial.example.com", memory=memory, timeout=30)
    async with FakeApiServer(memory).serving() as server, node:
        kubelet = node.kubelet
        kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
        config = driver_run_file(tmp_path / "config.yaml", node, kubeconfig, dev, api=api)
        args = ["run", "--config", str(config), "--device-plugin-dir", str(kubelet.directory)]
        first = devplugin_process(*args)
        try:
            await node.ready()
            started = time.monotonic()
            # Its start-up lines at info level, then the error (the warning level shows it alone).
            second = devplugin_process("--log-level", "warning", *args)
            try:
                _, stderr = await anyio.to_thread.run_sync(lambda: second.communicate(timeout=30))
            finally:
                second.kill()
                second.communicate()
            exit_s = time.monotonic() - started
            assert first.poll() is None  # the first one serves on
        finally:
            first.send_signal(signal.SIGTERM)
            try:
                await anyio.to_thread.run_sync(lambda: first.communicate(timeout=15))
            finally:
                first.kill()
                first.communicate()
    lines = stderr.splitlines()
    assert second.returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("devplugin: error: "), stderr
    # Each socket found served is named: dra.sock, and with api both the device plugin's too.
    assert lines[0].count("is served by another live process") == (2 if api == "both" else 1)
    assert first.returncode == 0
    figures(f"row 13 ({api})", rc=second.returncode, stderr_lines=len(lines), exit_s=exit_s)


# ----------------------------------------------------------------------------- row 7: the books


def test_the_kubelet_checkpoint_is_read_bounded_and_proves_nothing_when_unreadable(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    assert held_devices(path, ACME)[1] is None  # missing: nothing is proved released
    entries = [
        {"ResourceName": ACME, "DeviceIDs": {"-1": ["acme0"], "1": ["acme3"]}},
        {"ResourceName": "other.com/x", "DeviceIDs": {"-1": ["acme1"]}},
        {"ResourceName": ACME, "DeviceIDs": ["acme5"]},  # before Kubernetes 1.20
    ]
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries}, "Checksum": 1}))
    assert held_devices(path, ACME)[1] == {"acme0", "acme3", "acme5"}
    for damaged in ("{", "[]", '{"Data": {}}', "[" * 100_000):
        path.write_text(damaged)
        assert held_devices(path, ACME)[1] is None, damaged
    path.unlink()
    os.mkfifo(path)  # would block an open() for good
    started = time.monotonic()
    assert held_devices(path, ACME)[1] is None
    assert time.monotonic() - started < 1.0
