"""CDI spec faults on the node (issue 12, rows 5, 8, 9 and 13), each against a real plugin.

Every test runs ``devplugin run generic --config FILE`` with a ``cdi:`` key, as the image does,
against a FakeKubelet: the generic backend's devices are plain files in a temporary ``dev``
directory and the spec goes to a temporary CDI directory. Each prints its figures (a line
starting with ``figures``; ``pytest -s`` shows them), which docs/reliability.md quotes.

Faults are real: a second live instance, a process killed inside write(2), FIFOs, device nodes,
symlinks and a 1 GiB file at the spec path, and a full tmpfs (ENOSPC) where this machine lets an
unprivileged user mount one in a user namespace, with a file-size limit (EFBIG, the same failure
at the same point of the write) everywhere.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from plugin_process import PluginProcess, spawned
from sdk_helpers import figures

from devplugin_sdk.testing import FakeKubelet

# Each test starts two or three real plugin processes (about a second each on two busy cores)
# and waits for their registrations: more than the suite's 20 s per test.
pytestmark = pytest.mark.timeout(90)

RESOURCE = "reliability.example.com/widget"
SPEC = "reliability.example.com-widget.json"
LOCK = f".{SPEC}.lock"
LAUNCHER = Path(__file__).with_name("_cdi_launch.py")
# The whole plugin process, Python included, reads less than this; an unbounded read of
# /dev/zero or of a 1 GiB file reads far more.
READ_BOUND = 64 << 20
RSS_BOUND_KIB = 150 << 10  # the bound for any reload attempt; the manifest's limit is 128Mi


# ----------------------------------------------------------------------------- the node


@dataclass
class Node:
    """A temporary node: a fake /dev with widget files, a CDI directory and a config file."""

    root: Path
    kubelet: FakeKubelet

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def cdi(self) -> Path:
        return self.root / "cdi"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    def add_widget(self, number: int) -> None:
        (self.dev / f"widget{number}").touch()

    def write_config(self, *, share: int = 1, path: Path | None = None) -> Path:
        """Write the configuration (to ``path``, the node's file by default); return where."""
        path = path or self.config
        config = {
            "backend": "generic",
            "cdi": {"directory": str(self.cdi)},
            "resources": [
                {"resourceName": RESOURCE, "paths": [f"{self.dev}/widget*"], "share": share}
            ],
        }
        staged = path.with_name(f".{path.name}.new")
        staged.write_text(yaml.safe_dump(config), encoding="utf-8")
        os.replace(staged, path)
        return path

    def args(self, config: Path | None = None) -> list[str]:
        return [
            "run",
            "--config",
            str(config or self.config),
            "--device-plugin-dir",
            str(self.kubelet.directory),
            "--registration",
            "kubelet",
        ]


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    async with FakeKubelet() as kubelet:
        made = Node(tmp_path, kubelet)
        made.dev.mkdir()
        made.cdi.mkdir()
        made.add_widget(0)
        made.add_widget(1)
        made.write_config()
        yield made


def spec_names(path: Path) -> set[str]:
    data = json.loads(path.read_text())
    return {f"{data['kind']}={device['name']}" for device in data["devices"]}


def names(*ids: str) -> set[str]:
    return {f"{RESOURCE}={device_id}" for device_id in ids}


# ----------------------------------------------------------------------------- the process


class Plugin(PluginProcess):
    """A running plugin process, with what ``/proc`` shows of it."""

    def proc(self, name: str) -> dict[str, int]:
        """A /proc/PID file of ``key: number`` lines (status, io) as numbers."""
        values: dict[str, int] = {}
        for line in (Path("/proc") / str(self.pid) / name).read_text().splitlines():
            key, _, value = line.partition(":")
            with_unit = value.split()
            if with_unit and with_unit[0].isdigit():
                values[key] = int(with_unit[0])
        return values


@asynccontextmanager
async def running(command: Sequence[str]) -> AsyncIterator[Plugin]:
    """Run ``command`` for the body of the block; kill it at the end if it still runs."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc write under a file-size limit
    async with spawned(command, env=env, leave_with=signal.SIGKILL, handle=Plugin) as plugin:
        yield plugin


def devplugin(
    node: Node, *launcher: str, config: Path | None = None, log_level: str = "info"
) -> list[str]:
    return [sys.executable, str(LAUNCHER), *launcher, "--log-level", log_level, *node.args(config)]


# ----------------------------------------------------------------------------- row 5


async def test_a_refused_second_instance_leaves_the_first_ones_spec_alone(node: Node) -> None:
    spec = node.cdi / SPEC
    async with running(devplugin(node)) as first:
        await node.kubelet.wait_for_allocatable(RESOURCE, 2, timeout=30)
        before, inode = spec.read_bytes(), spec.stat().st_ino
        exits: list[float] = []
        # The same configuration, then one whose spec would differ (two shares per widget), each
        # in a file of its own (the first instance reloads its own file when it changes).
        for share in (1, 2):
            config = node.write_config(share=share, path=node.root / f"second-{share}.yaml")
            started = time.monotonic()
            async with running(devplugin(node, config=config)) as second:
                assert await second.exited(timeout=30) != 0
            exits.append(time.monotonic() - started)
            assert "served by another live process" in second.error_output
            assert "owned by another live plugin" in second.error_output
            assert spec.read_bytes() == before
            assert spec.stat().st_ino == inode
        # The first instance serves on, and its names resolve in the spec the runtime reads.
        got = await node.kubelet.allocate(RESOURCE, 2)
        assert set(got.allocation.cdi_devices) == names(*got.device_ids) <= spec_names(spec)
        assert await first.stop(20) == 0
    assert sorted(os.listdir(node.cdi)) == []  # its spec and lock, removed by their owner
    figures(
        "row 5",
        refused_instances=2,
        spec_bytes_changed=0,
        refused_exit_s=max(exits),
    )


# ----------------------------------------------------------------------------- row 8


async def test_a_write_killed_midway_leaves_a_temporary_file_the_next_start_removes(
    node: Node,
) -> None:
    spec = node.cdi / SPEC
    async with running(devplugin(node, "--die-on-file-size-limit")) as doomed:
        await node.kubelet.wait_for_allocatable(RESOURCE, 2, timeout=30)
        # The next spec write gets 100 bytes into its temporary file, then the kernel kills the
        # process inside write(2).
        hard = resource.prlimit(doomed.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(doomed.pid, resource.RLIMIT_FSIZE, (100, hard))
        node.add_widget(2)
        assert await doomed.exited(20) == -signal.SIGXFSZ
    left = sorted(p.name for p in node.cdi.iterdir())
    stale = [name for name in left if name.endswith(".tmp")]
    assert len(stale) == 1, left
    assert (node.cdi / stale[0]).stat().st_size == 100
    assert spec_names(spec) == names("widget0", "widget1")  # the old spec, whole
    assert LOCK in left  # a dead holder's lock file stays; the kernel released its lock

    started = time.monotonic()
    async with running(devplugin(node)) as second:
        await node.kubelet.wait_for_allocatable(RESOURCE, 3, timeout=30)
        serving = time.monotonic() - started
        assert "removed 1 temporary files an interrupted write left" in second.error_output
        assert sorted(os.listdir(node.cdi)) == [LOCK, SPEC]
        assert spec_names(spec) == names("widget0", "widget1", "widget2")
        # A real SIGKILL: the lock dies with its holder and never blocks the next start.
        second.process.send_signal(signal.SIGKILL)
        assert await second.exited(20) == -signal.SIGKILL
    async with running(devplugin(node)) as third:
        await node.kubelet.wait_for_registrations(RESOURCE, 3, timeout=30)
        await node.kubelet.wait_for_allocatable(RESOURCE, 3, timeout=30)
        assert "owned by another live plugin" not in third.error_output
        assert await third.stop(20) == 0
    assert os.listdir(node.cdi) == []
    figures("row 8", stale_temporary_files=1, left_after_restart=0, serving_after_restart_s=serving)


# ----------------------------------------------------------------------------- row 9


def fifo(path: Path) -> None:
    os.mkfifo(path)


def link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def dev_zero(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD (root on the node can)")


def gib_file(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(1 << 30)  # sparse: reading it would still return 1 GiB


def plant(path: Path, fault: Callable[[Path], None]) -> None:
    """Put ``fault`` at ``path`` in one rename, as a root user in the CDI directory could."""
    staged = path.with_name("staged")
    fault(staged)
    os.replace(staged, path)


@pytest.mark.parametrize("fault", [fifo, link_to_dev_zero, dev_zero, gib_file])
async def test_spec_path_that_is_a_fifo_a_device_or_huge_is_replaced_unread(
    node: Node, fault: Callable[[Path], None]
) -> None:
    spec = node.cdi / SPEC
    plant(spec, fault)
    started = time.monotonic()
    async with running(devplugin(node)) as plugin:
        await node.kubelet.wait_for_allocatable(RESOURCE, 2, timeout=30)
        serving = time.monotonic() - started
        assert stat.S_ISREG(os.lstat(spec).st_mode)
        assert spec_names(spec) == names("widget0", "widget1")
        # Again while it serves: the plugin's next write replaces it as well.
        plant(spec, fault)
        node.add_widget(2)
        await node.kubelet.wait_for_allocatable(RESOURCE, 3, timeout=30)
        assert stat.S_ISREG(os.lstat(spec).st_mode)
        assert spec_names(spec) == names("widget0", "widget1", "widget2")
        assert "not a regular file" in plugin.error_output or fault is gib_file
        read = plugin.proc("io")["rchar"]
        peak = plugin.proc("status")["VmHWM"]
        stopping = time.monotonic()
        assert await plugin.stop(20) == 0  # a FIFO once hung it in openat, deaf to SIGTERM
        stopped = time.monotonic() - stopping
    assert os.listdir(node.cdi) == []
    assert read < READ_BOUND
    assert peak < RSS_BOUND_KIB
    figures(
        f"row 9 {fault.__name__}",
        serving_s=serving,
        bytes_read_by_process=read,
        peak_rss_mib=round(peak / 1024, 1),
        sigterm_exit_s=stopped,
    )


# ----------------------------------------------------------------------------- row 13


def namespaces_work(directory: Path) -> str | None:
    """None if this user can mount a tmpfs in a new user and mount namespace; else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    directory.mkdir()
    probe = subprocess.run(
        [
            *("unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"),
            *("sh", "-c", 'mount -t tmpfs -o size=16k tmpfs "$0"', str(directory)),
        ],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return None if probe.returncode == 0 else probe.stderr.strip() or "unshare failed"


class FullTmpfs:
    """ENOSPC itself: the plugin runs in its own user and mount namespace with a 16 KiB tmpfs
    on the CDI directory, filled and emptied through /proc/PID/root."""

    failure = os.strerror(errno.ENOSPC)  # the errno's text, as the plugin logs it

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pid = 0

    def command(self) -> list[str]:
        mount = 'mount -t tmpfs -o size=16k,mode=0755 tmpfs "$0" && exec "$@"'
        return [
            *("unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"),
            *("sh", "-c", mount, str(self.node.cdi)),
            *devplugin(self.node, log_level="debug"),
        ]

    def cdi(self) -> Path:
        """The CDI directory as the plugin sees it."""
        return Path(f"/proc/{self.pid}/root{self.node.cdi}")

    def fill(self) -> None:
        fd = os.open(self.cdi() / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while True:
                try:
                    os.write(fd, b"\0" * 4096)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    return
        finally:
            os.close(fd)

    def free(self) -> None:
        (self.cdi() / "filler").unlink()


class FileSizeLimit:
    """EFBIG: the plugin's RLIMIT_FSIZE lowered below the spec's size, then raised again. The
    write fails at the same point as on a full disk (the temporary file exists, write(2)
    fails), on any machine."""

    failure = os.strerror(errno.EFBIG)

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pid = 0

    def command(self) -> list[str]:
        return devplugin(self.node, log_level="debug")

    def cdi(self) -> Path:
        return self.node.cdi

    def fill(self) -> None:
        hard = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (64, hard))

    def free(self) -> None:
        hard = resource.prlimit(self.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (hard, hard))


@pytest.mark.parametrize("disk", [FullTmpfs, FileSizeLimit])
async def test_devices_of_a_failed_spec_write_are_advertised_once_a_retry_writes_it(
    node: Node, disk: type[FullTmpfs | FileSizeLimit]
) -> None:
    if disk is FullTmpfs and (why := namespaces_work(node.root / "probe-mount")) is not None:
        pytest.skip(f"no tmpfs in a user namespace here: {why}")
    fault = disk(node)
    async with running(fault.command()) as plugin:
        fault.pid = plugin.pid
        await node.kubelet.wait_for_allocatable(RESOURCE, 2, timeout=30)
        spec = fault.cdi() / SPEC
        assert spec_names(spec) == names("widget0", "widget1")
        fault.fill()
        node.add_widget(2)  # the generic backend sees it at once and rewrites the spec
        failed = f"cannot write CDI spec {node.cdi / SPEC}: {fault.failure}"
        await plugin.wait_for_line(failed, timeout=20)
        # Retried with backoff (0.25 s, then 0.5 s, ...), each attempt failing while it is full.
        await plugin.wait_for_line("attempt 3)", timeout=20)
        # The kubelet is never told of widget2 while its name does not resolve; the devices
        # of the old spec keep serving.
        assert set(node.kubelet.devices(RESOURCE)) == {"widget0", "widget1"}
        assert spec_names(spec) == names("widget0", "widget1")
        got = await node.kubelet.allocate(RESOURCE, 1)
        assert set(got.allocation.cdi_devices) <= spec_names(spec)
        freed = time.monotonic()
        fault.free()
        await node.kubelet.wait_for_allocatable(RESOURCE, 3, timeout=30)
        recovered = time.monotonic() - freed
        assert spec_names(spec) == names("widget0", "widget1", "widget2")
        written = await plugin.wait_for_line("written after", timeout=20)
        attempts = int(written.split("written after ")[1].split()[0])
        assert attempts >= 3
        assert sum(failed in line for line in plugin.stderr) == attempts  # logged at error once
        assert not [p for p in os.listdir(fault.cdi()) if p.endswith(".tmp")]
        assert await plugin.stop(20) == 0
    figures(
        f"row 13 {fault.failure}",
        failed_attempts=attempts,
        recovered_after_freeing_s=recovered,
    )
