"""The DRA driver's prepared-claims store under faults (issue 25, rows 1, 8, 9, 14, 15 and 16).

The checkpoint and the per-claim CDI specs are one unit: a damaged checkpoint never costs a spec
the kubelet still uses, a hostile file at the checkpoint path is refused without being read, a
failed write leaves the spec and the record as they were. Each test runs a real driver (real
gRPC on unix sockets, real files) against FakeKubelet's DRA side and the in-memory API; the
hostile files are read in a child process, so that a read that never ends or takes gigabytes
fails the test instead of the machine. Figures are printed on lines starting with ``figures``
(``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE

from devplugin_sdk import Device, DeviceNode
from devplugin_sdk.dra import Dra
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DraNode, StaticPlugin

pytestmark = pytest.mark.timeout(60)

# A child process that reads a checkpoint must stay under these; today's unbounded read takes
# 650 MiB (a 300 MB file) to gigabytes (/dev/zero), or never ends (a FIFO).
READ_SECONDS = 10.0
RSS_BOUND_KIB = 150 << 10


def widgets(count: int = 4) -> list[Device]:
    return [
        Device(f"w{i}", device_nodes=(DeviceNode(f"/dev/widget{i}"),), env={"WIDGET": f"w{i}"})
        for i in range(count)
    ]


def node() -> DraNode:
    """A node whose driver serves four widgets."""
    return DraNode(StaticPlugin(RESOURCE, widgets()), driver=DRIVER)


def restarted(node: DraNode) -> AbstractAsyncContextManager[None]:
    """The driver stopped for the body, then a new process of it (new plugin objects) ready."""
    return node.stopped(StaticPlugin(RESOURCE, widgets()))


def specs(options: Dra) -> list[str]:
    return sorted(p.name for p in options.cdi_dir.glob(f"k8s.{DRIVER}-claim_*.json"))


def checkpoint(options: Dra) -> Path:
    assert options.plugin_dir is not None
    return options.plugin_dir / "checkpoint.json"


def recorded(options: Dra) -> dict[str, object]:
    """The claims the checkpoint on disk holds (none when there is no file yet)."""
    path = checkpoint(options)
    return json.loads(path.read_bytes())["claims"] if path.exists() else {}  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- row 1


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _unreadable(path: Path) -> None:
    # Tests run as root on CI, where a mode bit stops no read: a directory cannot be read as a
    # file by anyone.
    path.unlink()
    path.mkdir()


def _newer(path: Path) -> None:
    data = json.loads(path.read_text())
    data["format"] = 99  # a later version wrote it, then the driver was rolled back
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage", [_truncate, _unreadable, _newer], ids=lambda f: f.__name__)
async def test_a_damaged_checkpoint_deletes_no_spec_the_kubelet_holds(
    damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    async with node() as dra:
        kubelet, options = dra.kubelet, dra.options
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        first = await dra.prepare(pod)
        async with restarted(dra):
            held = specs(options)
            assert len(held) == 1
            assert callable(damage)
            damage(checkpoint(options))

            caplog.clear()
            caplog.set_level(logging.INFO, logger="devplugin_sdk")
            started = time.monotonic()
        running = dra.running
        start = time.monotonic() - started
        # The kubelet still holds the claim prepared: its CDI ID must keep resolving.
        assert specs(options) == held, "a spec the kubelet holds was deleted"
        assert running.dra is not None
        assert running.dra.prepared_claims == 1
        assert running.dra.recovered_claims == 1
        aside = [p.name for p in checkpoint(options).parent.iterdir() if "corrupt" in p.name]
        assert aside == ["checkpoint.json.corrupt"]
        said = [
            r.getMessage()
            for r in caplog.records
            if "checkpoint" in r.getMessage() and r.levelno >= logging.WARNING
        ]
        assert len(said) == 1, said
        assert "\n" not in said[0]
        assert "kept 1 CDI spec" in said[0], said[0]

        # A restart before the kubelet asks anything still keeps it (the kept spec is
        # recorded in the new checkpoint).
        async with restarted(dra):
            pass
        assert specs(options) == held

        # The kubelet asks again (its own restart): the same CDI IDs, a complete record.
        kubelet.dra.forget_prepared()
        again = await dra.prepare(pod)
        assert again.claims == first.claims
        await dra.unprepare(pod)
        assert specs(options) == []
        print(f"figures row 1 {damage.__name__}: specs kept 1 of 1, start {start * 1000:.0f} ms")


# ----------------------------------------------------------------------------- row 8


# The child limits its own memory before it imports anything: a preexec_fn would run Python in
# the forked child of a process whose gRPC threads are running, which gRPC's fork handlers skip
# ("Other threads are currently calling into gRPC"), and the child could abort before its exec.
_READER = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from pathlib import Path
from devplugin_sdk.dra._claims.checkpoint import Checkpoint
started = time.monotonic()
loaded = Checkpoint(Path(sys.argv[1])).load()
took = time.monotonic() - started
# VmHWM, the peak of this process's own memory since its exec (ru_maxrss would count the
# parent's, which a child started without a fork of its own shares until the exec).
peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(len(loaded.entries), loaded.problem is not None, f"{took:.3f}", peak)
"""


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _deep(path: Path) -> None:
    path.write_text('{"format": 1, "claims": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _huge(path: Path) -> None:
    with path.open("wb") as f:  # sparse: 300 MB of zeros that take no disk
        f.truncate(300_000_000)


@pytest.mark.parametrize("hostile", [_fifo, _dev_zero, _deep, _huge], ids=lambda f: f.__name__)
def test_a_hostile_checkpoint_is_refused_unread(hostile: object, short_dir: Path) -> None:
    path = short_dir / "checkpoint.json"
    assert callable(hostile)
    hostile(path)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _READER, str(path)],
            capture_output=True,
            text=True,
            timeout=READ_SECONDS * 3,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {hostile.__name__} did not end in {READ_SECONDS * 3:g} s")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    entries, problem, seconds, rss_kib = done.stdout.split()
    assert (entries, problem) == ("0", "True")
    assert float(seconds) < READ_SECONDS
    assert int(rss_kib) < RSS_BOUND_KIB, f"{int(rss_kib) >> 10} MiB"
    # The hostile file is set aside, never left where the next start trips on it.
    assert not path.exists()
    assert not path.is_symlink()
    assert (short_dir / "checkpoint.json.corrupt").exists() or (
        short_dir / "checkpoint.json.corrupt"
    ).is_symlink()
    print(
        f"figures row 8 {hostile.__name__}: read {float(seconds) * 1000:.1f} ms, "
        f"child {took:.2f} s, RSS {int(rss_kib) >> 10} MiB"
    )


# ----------------------------------------------------------------------------- row 9


async def test_the_plugin_directory_and_checkpoint_are_private_under_umask_000() -> None:
    old = os.umask(0)
    try:
        async with node() as dra:
            options = dra.options
            pod = dra.pod("c1", name="pod-a", namespace="ns")
            dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
            await dra.prepare(pod)
            assert options.plugin_dir is not None
            directory = stat.S_IMODE(options.plugin_dir.stat().st_mode)
            record = stat.S_IMODE(checkpoint(options).stat().st_mode)
    finally:
        os.umask(old)
    assert (oct(directory), oct(record)) == ("0o700", "0o600")
    print(f"figures row 9: umask 000: directory {oct(directory)}, checkpoint {oct(record)}")


async def test_a_checkpoint_others_could_write_is_not_trusted() -> None:
    """A checkpoint group or others could have replaced is set aside, as a damaged one is."""
    async with node() as dra:
        options = dra.options
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        await dra.prepare(pod)
        async with restarted(dra):
            held = specs(options)
            checkpoint(options).chmod(0o666)
        running = dra.running
        assert specs(options) == held
        assert running.dra is not None
        assert running.dra.recovered_claims == 1


# ----------------------------------------------------------------------------- row 14


async def test_unprepare_with_an_unwritable_checkpoint_keeps_spec_and_record() -> None:
    async with node() as dra:
        kubelet, options, running = dra.kubelet, dra.options, dra.running
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        first = await dra.prepare(pod)
        held = specs(options)
        path = checkpoint(options)
        saved = path.read_bytes()
        path.unlink()
        path.mkdir()  # the next write's rename fails, for root too
        with pytest.raises(PodPreparationError, match="cannot unprepare"):
            await dra.unprepare(pod)
        assert specs(options) == held, "the spec went while its claim stayed recorded"
        assert running.dra is not None
        assert running.dra.prepared_claims == 1
        # The record and the spec still agree: asking again answers IDs that resolve.
        kubelet.dra.forget_prepared()
        assert (await dra.prepare(pod)).claims == first.claims
        path.rmdir()
        path.write_bytes(saved)
        await dra.unprepare(pod)
        assert specs(options) == []
        assert running.dra.prepared_claims == 0


async def test_a_prepare_that_cannot_be_recorded_leaves_no_spec() -> None:
    async with node() as dra:
        options, running = dra.options, dra.running
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        path = checkpoint(options)
        path.unlink(missing_ok=True)
        path.mkdir()
        with pytest.raises(PodPreparationError, match="cannot write the checkpoint"):
            await dra.prepare(pod)
        assert specs(options) == [], "a spec no record names was left behind"
        assert running.dra is not None
        assert running.dra.prepared_claims == 0
        path.rmdir()
        await dra.prepare(pod)
        assert len(specs(options)) == 1


async def test_a_prepare_whose_metadata_cannot_be_written_leaves_no_spec_and_no_record() -> None:
    # The metadata, the spec and the staged checkpoint are written at once (issue 29): a
    # failure of one takes the others back, and the checkpoint is never renamed into place.
    async with node() as dra:
        options, running = dra.options, dra.running
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        assert options.plugin_dir is not None
        claim = dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        blocker = options.plugin_dir / "dra-device-metadata" / claim.uid
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("in the way")  # the claim's directory cannot be made
        with pytest.raises(PodPreparationError, match="cannot write the device metadata"):
            await dra.prepare(pod)
        assert specs(options) == [], "a spec no record names was left behind"
        assert recorded(options) == {}
        assert not list(options.plugin_dir.glob(".checkpoint.json.*.tmp"))
        assert running.dra is not None
        assert running.dra.prepared_claims == 0
        blocker.unlink()
        await dra.prepare(pod)
        assert len(specs(options)) == 1
        assert running.dra.prepared_claims == 1


async def test_a_prepare_whose_spec_cannot_be_written_records_nothing() -> None:
    async with node() as dra:
        options, running = dra.options, dra.running
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        assert options.plugin_dir is not None
        claim = dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        spec = dra.spec_path(claim)
        spec.mkdir(parents=True)  # the rename over it fails, for root too
        (spec / "keep").write_text("")
        with pytest.raises(PodPreparationError, match="cannot write CDI spec"):
            await dra.prepare(pod)
        assert recorded(options) == {}, "the record named a missing spec"
        assert not list(options.plugin_dir.glob(".checkpoint.json.*.tmp"))
        assert running.dra is not None
        assert running.dra.prepared_claims == 0


# ----------------------------------------------------------------------------- rows 15, 16


async def test_claim_names_with_control_characters_are_escaped_in_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = "c1\n2026-01-01 00:00:00 INFO devplugin_sdk: forged \x1b[31mred"
    caplog.set_level(logging.DEBUG, logger="devplugin_sdk")
    async with node() as dra:
        api = dra.api
        pod = dra.pod(forged, name="pod-a", namespace="ns\x1b[2J")
        api.add_claim("ns\x1b[2J", forged, uid="u\n1\x1b")
        api.allocate(
            "ns\x1b[2J", forged, {"r": ["w1"]}, driver=DRIVER, pool="node-1", pods=[pod.uid]
        )
        with pytest.raises(PodPreparationError, match="UID"):
            await dra.prepare(pod)
        good = dra.pod("c2\nforged", name="pod-b", namespace="ns\x1b[2J")
        api.allocate(
            "ns\x1b[2J",
            "c2\nforged",
            {"r": ["w2"]},
            driver=DRIVER,
            pool="node-1",
            pods=[good.uid],
        )
        # Issue 36: a namespace that is no DNS label is refused before any file is named.
        with pytest.raises(PodPreparationError, match="not a valid namespace"):
            await dra.prepare(good)
        await dra.unprepare(good)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("devplugin_sdk")]
    claims = [m for m in ours if "claim" in m and "ns" in m]
    assert len(claims) >= 3, ours
    for message in ours:
        assert message.isprintable(), repr(message)


async def test_a_claim_listing_one_device_twice_fails_alone() -> None:
    async with node() as dra:
        api, options, running = dra.api, dra.options, dra.running
        twice = dra.pod("c1", name="pod-a", namespace="ns")
        # No scheduler allocates this (MemoryApi refuses it too): check=False forces it.
        api.allocate(
            "ns",
            "c1",
            {"r": ["w3", "w3"]},
            driver=DRIVER,
            pool="node-1",
            pods=[twice.uid],
            check=False,
        )
        with pytest.raises(PodPreparationError, match="w3 twice"):
            await dra.prepare(twice)
        assert specs(options) == []
        api.deallocate("ns", "c1")
        fine = dra.pod("c2", name="pod-b", namespace="ns")
        dra.claim("c2", {"r": ["w3"]}, pods=[fine], namespace="ns")
        assert (await dra.prepare(fine)).claims
        assert running.dra is not None
        assert running.dra.prepared_claims == 1


def test_the_checkpoint_reencodes_only_what_changed_and_reads_back_what_it_wrote(
    tmp_path: Path,
) -> None:
    # Each claim's line is encoded once and reused while its entry stays the same (issue 29);
    # a replaced entry (a recovered one prepared in full) gets its new line.
    from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
    from devplugin_sdk.dra._claims.checkpoint import Checkpoint, Entry

    def entry(i: int, *, recovered: bool = False) -> Entry:
        device = PreparedDevice(("r",), "node-1", f"w{i}", (f"k8s.{DRIVER}/claim=u{i}-r",))
        return Entry(
            ClaimRef("ns", f"u{i}", f"c{i}"), () if recovered else (device,), None, recovered
        )

    store = Checkpoint(tmp_path / "checkpoint.json")
    entries = {f"u{i}": entry(i, recovered=i == 1) for i in range(3)}
    store.save(entries)
    assert store.load().entries == entries
    entries["u1"] = entry(1)
    del entries["u0"]
    store.save(entries)
    assert store.load().entries == entries
    store.save({})
    assert store.load().entries == {}
    assert json.loads((tmp_path / "checkpoint.json").read_bytes()) == {
        "claims": {},
        "format": 2,
        "generation": 3,
    }


# ----------------------------------------------------------------------------- formats

#: A checkpoint as nodes hold it in format 1 (before the generation): one claim with a shared
#: device's share and one recovered from its CDI spec.
_FORMAT_1 = (
    '{"claims": {\n'
    ' "6f1c2b9e-0d2a-4b8e-9c3f-1a2b3c4d5e6f": {"devices": [{"cdiDeviceIDs": '
    f'["k8s.{DRIVER}/claim=6f1c2b9e-0d2a-4b8e-9c3f-1a2b3c4d5e6f-gpu"], "device": "w0", '
    '"pool": "node-1", "requests": ["gpu"], "shareID": "s-1"}], "name": "c1", '
    '"namespace": "ns", '
    f'"specFile": "k8s.{DRIVER}-claim_6f1c2b9e-0d2a-4b8e-9c3f-1a2b3c4d5e6f.json", '
    '"uses": [{"device": "w0", "shareID": "s-1", "shares": 2}]},\n'
    ' "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d": {"devices": [], "name": "", "namespace": "", '
    '"recovered": true, '
    f'"specFile": "k8s.{DRIVER}-claim_9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d.json"}}\n'
    '}, "format": 1}\n'
)


def test_a_format_1_checkpoint_loads_and_the_next_save_writes_format_2(tmp_path: Path) -> None:
    from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
    from devplugin_sdk.dra._claims.checkpoint import Checkpoint, Entry
    from devplugin_sdk.dra._claims.shares import Use

    path = tmp_path / "checkpoint.json"
    path.write_text(_FORMAT_1)
    path.chmod(0o600)
    store = Checkpoint(path)
    loaded = store.load()
    assert loaded.problem is None
    assert (loaded.converted_from, loaded.generation) == (1, 0)
    shared = "6f1c2b9e-0d2a-4b8e-9c3f-1a2b3c4d5e6f"
    recovered = "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
    assert loaded.entries == {
        shared: Entry(
            ClaimRef("ns", shared, "c1"),
            (
                PreparedDevice(
                    ("gpu",), "node-1", "w0", (f"k8s.{DRIVER}/claim={shared}-gpu",), "s-1"
                ),
            ),
            f"k8s.{DRIVER}-claim_{shared}.json",
            uses=(Use("w0", "s-1", 2),),
        ),
        recovered: Entry(
            ClaimRef("", recovered, ""), (), f"k8s.{DRIVER}-claim_{recovered}.json", True
        ),
    }
    store.save(loaded.entries)
    written = json.loads(path.read_bytes())
    assert (written["format"], written["generation"]) == (2, 1)
    again = Checkpoint(path).load()
    assert (again.entries, again.generation, again.converted_from) == (loaded.entries, 1, None)


def test_a_format_2_checkpoint_round_trips_and_counts_its_saves(tmp_path: Path) -> None:
    from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
    from devplugin_sdk.dra._claims.checkpoint import Checkpoint, Entry

    path = tmp_path / "checkpoint.json"
    device = PreparedDevice(("r",), "node-1", "w1", (f"k8s.{DRIVER}/claim=u1-r",))
    entries = {"u1": Entry(ClaimRef("ns", "u1", "c1"), (device,), f"k8s.{DRIVER}-claim_u1.json")}
    first = Checkpoint(path)
    first.save(entries)
    first.save(entries)
    text = path.read_bytes()
    assert json.loads(text)["generation"] == 2
    loaded = Checkpoint(path).load()
    assert (loaded.problem, loaded.entries, loaded.generation) == (None, entries, 2)
    reader = Checkpoint(path)
    reader.load()
    reader.save(loaded.entries)  # the next save after another writer's counts on from it
    assert json.loads(path.read_bytes()) == {**json.loads(text), "generation": 3}


def test_a_checkpoint_of_a_newer_format_is_set_aside(tmp_path: Path) -> None:
    from devplugin_sdk.dra._claims.checkpoint import Checkpoint

    content = '{"claims": {}, "format": 3, "generation": 1}'
    path = tmp_path / "checkpoint.json"
    path.write_text(content)
    path.chmod(0o600)
    loaded = Checkpoint(path).load()
    assert loaded.problem is not None
    assert "unknown format 3" in loaded.problem
    assert loaded.entries == {}
    assert loaded.aside == tmp_path / "checkpoint.json.corrupt"
    assert loaded.aside.read_text() == content  # kept for the operator, never read as ours
    assert not path.exists()


async def test_a_damaged_checkpoint_deletes_no_spec_in_a_rolling_upgrade_either() -> None:
    # With a pod UID every start reads the checkpoint under serialize.lock: it is read once, so
    # the damaged file is reported and its specs kept, as without one. Each start is a new pod
    # of the DaemonSet, with a UID of its own (pod_uid None).
    plugin = StaticPlugin(RESOURCE, widgets())
    async with DraNode(plugin, driver=DRIVER, settings={"pod_uid": None}) as dra:
        options = dra.options
        pod = dra.pod("c1", name="pod-a", namespace="ns")
        dra.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        await dra.prepare(pod)
        held = specs(options)
        assert len(held) == 1
        async with dra.stopped():
            _truncate(checkpoint(options))
        assert specs(options) == held, "a spec the kubelet holds was deleted"
        status = dra.status
        assert status.recovered_claims == 1
        assert status.checkpoint_corrupted == 1
