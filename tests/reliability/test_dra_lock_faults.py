"""The serialization lock of a DRA driver's instances, and what runs under it (issue 36, rows 5,
9, 10 and 24).

During a rolling upgrade two instances of the driver share the checkpoint and ``serialize.lock``
(an exclusive ``flock``). These tests run a real driver (real gRPC on unix sockets, real files)
against FakeKubelet's DRA side and the in-memory API; the other instance is a real second
process holding the lock, or its write replayed byte for byte on the checkpoint. Figures are
printed on lines starting with ``figures`` (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import anyio
import pytest
from dra_helpers import DRIVER, devplugin_process, driver_run_file
from kube_apiserver import FakeApiServer
from sdk_helpers import RESOURCE

from devplugin_sdk import Allocation, Device, DeviceNode
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DaemonSetPod, DraNode, MemoryApi, StaticPlugin, serving

pytestmark = pytest.mark.timeout(60)


def widgets(count: int = 4) -> list[Device]:
    return [
        Device(f"w{i}", device_nodes=(DeviceNode(f"/dev/widget{i}"),), env={"WIDGET": f"w{i}"})
        for i in range(count)
    ]


def lock_file(node: DraNode) -> Path:
    return node.options.resolved_plugin_dir / "serialize.lock"


@contextlib.contextmanager
def held_by_another_process(path: Path) -> Iterator[subprocess.Popen[str]]:
    """A second process holding ``path``'s exclusive flock for the body (as another instance of
    the driver in the middle of a call, or stuck in one)."""
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        assert holder.stdin is not None
        holder.stdin.close()  # the holder ends: the kernel releases its flock
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()


def said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ----------------------------------------------------------------------------- row 5


async def test_another_instances_checkpoint_written_in_place_within_one_mtime_tick_is_read() -> (
    None
):
    """Instance B rewrote the checkpoint in place (the inode reused), with the same size and
    within one mtime tick: every part of an (inode, size, mtime) stamp is unchanged, the
    generation in the file is not."""
    async with DraNode(
        StaticPlugin(RESOURCE, widgets()), driver=DRIVER, settings={"pod_uid": None}
    ) as node:
        pod1 = node.pod("c1", name="pod-1")
        c1 = node.claim("c1", {"r": ["w1"]}, pods=[pod1])
        await node.prepare(pod1)
        pod2 = node.pod("c2", name="pod-2")
        c2 = node.claim("c2", {"r": ["w2"]}, pods=[pod2])
        path = node.options.resolved_plugin_dir / "checkpoint.json"
        before = os.stat(path)
        text = path.read_text()
        assert json.loads(text)["generation"] == 1
        # What B wrote under the lock: c1 unprepared, c2 prepared on w2 (same lengths: the same
        # size), the next generation.
        theirs = (
            text.replace(c1.uid, c2.uid)
            .replace('"name": "c1"', '"name": "c2"')
            .replace('"w1"', '"w2"')
            .replace('"generation": 1}', '"generation": 2}')
        )
        assert len(theirs) == len(text)
        spec = node.spec_path(c1).read_text().replace(c1.uid, c2.uid).replace("w1", "w2")
        node.spec_path(c2).write_text(spec)
        node.spec_path(c1).unlink()
        fd = os.open(lock_file(node), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with path.open("r+") as f:  # in place: the inode is reused
                f.write(theirs)
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        finally:
            os.close(fd)
        after = os.stat(path)
        stamp = (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns)
        assert stamp == (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)

        # A claim for w2, which c2 holds: instance A must see B's record and refuse it.
        pod3 = node.pod("c3", name="pod-3")
        node.claim("c3", {"r": ["w2"]}, pods=[pod3], check=False)
        with pytest.raises(PodPreparationError, match="already prepared for claim default/c2"):
            await node.prepare(pod3)
        claims = json.loads(path.read_text())["claims"]
        assert set(claims) == {c2.uid}, "B's record lost, or the claim B unprepared back"
        # The kubelet asks A for c2 (its restart): B's answer, then A unprepares it.
        assert (await node.prepare(pod2)).cdi_ids("c2") == [f"k8s.{DRIVER}/claim={c2.uid}-r"]
        await node.unprepare(pod2)
        assert json.loads(path.read_text())["claims"] == {}
        assert not node.spec_path(c2).exists()
        print("figures row 5: w2 given twice 0 of 1; records after: c2 only (B's)")


# ----------------------------------------------------------------------------- row 9


async def test_prepare_behind_a_lock_held_by_another_process_fails_per_claim_and_says_who(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="devplugin_sdk")
    async with DraNode(
        StaticPlugin(RESOURCE, widgets()),
        driver=DRIVER,
        settings={"pod_uid": None},
        lock_timeout=1.5,
    ) as node:
        pod = node.pod("c1", name="pod-1")
        node.claim("c1", {"r": ["w1"]}, pods=[pod])
        with held_by_another_process(lock_file(node)) as holder:
            started = time.monotonic()
            with anyio.fail_after(10), pytest.raises(PodPreparationError) as refused:
                await node.prepare(pod)
            waited = time.monotonic() - started
            assert "serialize.lock" in str(refused.value)
            waiting = said(caplog, "waiting for")
            assert len(waiting) == 1, waiting
            assert str(lock_file(node)) in waiting[0]
            assert f"pid {holder.pid}" in waiting[0]
            assert "\n" not in waiting[0]
        # The holder gone, the kubelet's retry succeeds.
        prepared = await node.prepare(pod)
        assert prepared.cdi_ids("c1")
        print(f"figures row 9 serving: answered in {waited:.2f} s (bound 1.5 s), was never")


async def test_sigterm_while_the_start_waits_for_the_lock_is_honoured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="devplugin_sdk")
    async with DraNode(driver=DRIVER, lock_timeout=30.0) as node:
        lock = node.options.resolved_plugin_dir / "serialize.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        settings = node.kubelet.settings(stop_timeout=3.0, pod_uid=str(uuid.uuid4()))
        scope, done = anyio.CancelScope(), anyio.Event()

        async def run() -> None:  # a pod whose start never ends, until its SIGTERM
            try:
                with scope:
                    plugin = StaticPlugin(RESOURCE, widgets())
                    async with serving(plugin, settings=settings, api="dra", dra=node.options):
                        await anyio.sleep_forever()
            finally:
                done.set()

        with held_by_another_process(lock):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await node.kubelet.wait_for(
                    lambda: bool(said(caplog, "waiting for")), what="the wait logged", timeout=15
                )
                started = time.monotonic()
                scope.cancel()  # SIGTERM
                with anyio.fail_after(9):
                    await done.wait()
                stopped = time.monotonic() - started
        assert stopped < settings.stop_timeout
        print(f"figures row 9 start: SIGTERM honoured in {stopped:.2f} s (was ignored for 10 s)")


async def test_a_start_that_cannot_take_the_lock_in_time_refuses_naming_it() -> None:
    async with DraNode(driver=DRIVER, lock_timeout=1.0) as node:
        lock = node.options.resolved_plugin_dir / "serialize.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        pod = DaemonSetPod(
            StaticPlugin(RESOURCE, widgets()),
            settings=node.kubelet.settings(),
            api="dra",
            dra=node.options,
        )
        with held_by_another_process(lock) as holder:
            with anyio.fail_after(10), pytest.raises(Exception) as refused:  # noqa: PT011
                async with anyio.create_task_group() as tg:
                    await pod.start(tg)
        message = str(_leaf(refused.value))
        assert str(lock) in message
        assert f"pid {holder.pid}" in message
        assert "\n" not in message


def _leaf(exc: BaseException) -> BaseException:
    while inner := getattr(exc, "exceptions", None):  # an exception group: its first
        exc = inner[0]
    return exc


# ----------------------------------------------------------------------------- row 24


def _directory(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


def _symlink_loop(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(path.name)  # points at itself


@pytest.mark.parametrize("bad", [_directory, _symlink_loop], ids=lambda f: f.__name__)
async def test_a_bad_lock_path_fails_each_claim_with_one_clear_line(
    bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    async with DraNode(
        StaticPlugin(RESOURCE, widgets()), driver=DRIVER, settings={"pod_uid": None}
    ) as node:
        pod = node.pod("c1", "c2", name="pod-1")
        node.claim("c1", {"r": ["w1"]}, pods=[pod])
        node.claim("c2", {"r": ["w2"]}, pods=[pod])
        assert callable(bad)
        bad(lock_file(node))
        caplog.set_level(logging.INFO, logger="devplugin_sdk")
        with pytest.raises(PodPreparationError) as refused:
            await node.prepare(pod)
        text = str(refused.value)
        assert "Unexpected" not in text
        assert str(lock_file(node)) in text
        assert ("a directory" if bad is _directory else "symbolic link") in text
        lines = said(caplog, "serialize.lock")
        assert lines, "nothing logged"
        assert all("\n" not in line for line in lines)
        print(f"figures row 24 {bad.__name__} serving: {text}")


@pytest.mark.parametrize("bad", [_directory, _symlink_loop], ids=lambda f: f.__name__)
async def test_a_bad_lock_path_at_start_is_a_clean_refusal(
    bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    async with DraNode(driver=DRIVER) as node:
        lock = node.options.resolved_plugin_dir / "serialize.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        assert callable(bad)
        bad(lock)
        pod = DaemonSetPod(
            StaticPlugin(RESOURCE, widgets()),
            settings=node.kubelet.settings(),
            api="dra",
            dra=node.options,
        )
        with anyio.fail_after(10), pytest.raises(Exception) as refused:  # noqa: PT011
            async with anyio.create_task_group() as tg:
                await pod.start(tg)
        leaf = _leaf(refused.value)
        message = str(leaf)
        assert str(lock) in message
        assert "\n" not in message
        assert type(leaf).__name__ == "LockError", repr(leaf)
        assert not [r.getMessage() for r in caplog.records if r.exc_info], "a traceback logged"
        print(f"figures row 24 {bad.__name__} start: {message}")


# ----------------------------------------------------------------------------- row 10


class _Hanging(StaticPlugin):
    """``allocate()`` for w0 hangs (a TimeSlicing ``nvidia-smi`` that never returns) until the
    test lets it go."""

    def __init__(self, devices: Sequence[Device]) -> None:
        super().__init__(RESOURCE, devices)
        self.entered = anyio.Event()
        self.release = anyio.Event()

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        if any(d.id == "w0" for d in devices):
            self.entered.set()
            await self.release.wait()
        return await super().allocate(devices)


async def test_a_hanging_hook_delays_no_claim_on_another_device() -> None:
    plugin = _Hanging(widgets())
    async with DraNode(
        plugin, driver=DRIVER, settings={"pod_uid": None, "hook_timeout": 6.0}
    ) as node:
        slow = node.pod("c0", name="pod-0")
        node.claim("c0", {"r": ["w0"]}, pods=[slow])
        other = node.pod("c1", name="pod-1")
        node.claim("c1", {"r": ["w1"]}, pods=[other])
        rival = node.pod("c9", name="pod-9")
        node.claim("c9", {"r": ["w0"]}, pods=[rival], check=False)  # w0 twice: never both
        finished: dict[str, float] = {}

        async def prepare_slow() -> None:
            await node.prepare(slow)
            finished["slow"] = time.monotonic()

        async with anyio.create_task_group() as tg:
            tg.start_soon(prepare_slow)
            await plugin.entered.wait()
            started = time.monotonic()
            prepared = await node.prepare(other)
            latency = time.monotonic() - started
            assert prepared.cdi_ids("c1")
            assert "slow" not in finished, "the other claim waited for the hanging hook"
            with pytest.raises(PodPreparationError, match="w0"):
                await node.prepare(rival)
            plugin.release.set()
        assert node.spec(node.api.claims[("default", "c0")]).devices
        print(f"figures row 10: the other claim's prepare {latency * 1000:.0f} ms (was 6 s)")


# ----------------------------------------------------------------------------- rows 9, 24: `devplugin run`


def _run_config(tmp_path: Path, node: DraNode, kubeconfig: Path) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "ttyUSB0").touch()
    return driver_run_file(tmp_path / "config.yaml", node, kubeconfig, dev)


@contextlib.asynccontextmanager
async def _devplugin_run(tmp_path: Path) -> AsyncIterator[tuple[DraNode, list[str]]]:
    """The node (no driver of its own) and the arguments of a `devplugin run` of its driver as
    one pod of a rolling upgrade (``POD_UID`` set)."""
    memory = MemoryApi(nodes=["node-1"])
    node = DraNode(driver="serial.example.com", memory=memory, timeout=30)
    async with FakeApiServer(memory).serving() as server, node:
        kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
        config = _run_config(tmp_path, node, kubeconfig)
        lock = node.options.resolved_plugin_dir / "serialize.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        yield (
            node,
            ["run", "--config", str(config), "--device-plugin-dir", str(node.kubelet.directory)],
        )


def _devplugin(*args: str) -> subprocess.Popen[str]:
    """A ``devplugin`` process of its own pod (a UID: instances share ``serialize.lock``)."""
    return devplugin_process(*args, env={"POD_UID": str(uuid.uuid4())})


async def _ended(process: subprocess.Popen[str], timeout: float) -> str:
    try:
        _, stderr = await anyio.to_thread.run_sync(lambda: process.communicate(timeout=timeout))
    finally:
        process.kill()
        process.communicate()
    return stderr


@pytest.mark.parametrize("bad", [_directory, _symlink_loop], ids=lambda f: f.__name__)
async def test_devplugin_run_refuses_a_bad_lock_path_with_one_line(
    tmp_path: Path, bad: object
) -> None:
    async with _devplugin_run(tmp_path) as (node, args):
        assert callable(bad)
        bad(node.options.resolved_plugin_dir / "serialize.lock")
        process = _devplugin("--log-level", "warning", *args)
        stderr = await _ended(process, 30)
    lines = stderr.splitlines()
    assert process.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("devplugin: error: cannot use the instances' lock "), stderr
    print(f"figures row 24 {bad.__name__} devplugin run: rc {process.returncode}, {lines[0]}")


async def test_devplugin_run_waiting_for_the_lock_says_so_and_honours_sigterm(
    tmp_path: Path,
) -> None:
    async with _devplugin_run(tmp_path) as (node, args):
        lock = node.options.resolved_plugin_dir / "serialize.lock"
        with held_by_another_process(lock) as holder:
            process = _devplugin("--log-level", "warning", *args)
            try:
                assert process.stderr is not None
                line = await anyio.to_thread.run_sync(process.stderr.readline)
                assert "waiting for the instances' lock" in line, line
                assert str(lock) in line
                assert f"pid {holder.pid}" in line
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                rest = await _ended(process, 15)
                stopped = time.monotonic() - started
            finally:
                process.kill()
    assert "Traceback" not in rest, rest
    assert stopped < 10.0  # Settings.stop_timeout's default
    print(
        f"figures row 9 devplugin run: SIGTERM while waiting for the lock, exit in {stopped:.2f} s"
    )


def test_after_setting_another_instances_file_aside_the_next_save_is_news_to_it(
    tmp_path: Path,
) -> None:
    """Row 5's other half: a file set aside (here: a newer format, after a rollback) must not
    make this instance write a generation the other instance already knows as its own."""
    from devplugin_sdk.dra._claims.checkpoint import Checkpoint

    path = tmp_path / "checkpoint.json"
    ours, theirs = Checkpoint(path), Checkpoint(path)
    ours.save({})
    theirs.load()
    theirs.save({})
    assert theirs.written_generation() == 2  # ours would write 2 next
    path.write_text(path.read_text().replace('"format": 2', '"format": 99'))  # same generation
    assert ours.changed()
    assert ours.load().problem is not None  # set aside
    ours.save({})
    assert theirs.changed(), "the other instance would take our file for its own"
    assert theirs.load().problem is None
