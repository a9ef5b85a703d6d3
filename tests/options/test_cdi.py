"""CDI: spec JSON, name rules, atomic files, and plugins served through ``use_cdi``."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from sdk_helpers import widgets

from devplugin_sdk import (
    Allocation,
    BackendError,
    Device,
    DeviceNode,
    Health,
    Mount,
    replicate,
)
from devplugin_sdk.cdi import (
    CdiPlugin,
    CdiSpec,
    cdi_name,
    remove_spec,
    spec_file_name,
    use_cdi,
    validate_device_name,
    validate_kind,
    write_spec,
)
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving
from devplugin_sdk.types import HealthEvent, RescanEvent

KIND = "acme.com/widget"


def spec_devices(path: Path) -> dict[str, dict[str, Any]]:
    """The written spec's devices by fully qualified name."""
    data = json.loads(path.read_text())
    return {f"{data['kind']}={d['name']}": d["containerEdits"] for d in data["devices"]}


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "kind", ["vendor.com/foo", "foo.bar.baz/foo-bar123.B_az", "nvidia.com/gpu", "a/b"]
)
def test_valid_kinds_are_accepted(kind: str) -> None:
    vendor, klass = validate_kind(kind)
    assert f"{vendor}/{klass}" == kind


@pytest.mark.parametrize(
    ("kind", "rule"),
    [
        ("foo", "vendor.com/class"),
        ("vendor.com/foo/", "end with a letter or digit"),
        ("vendor.com/foo/bar", "may only contain"),
        ("/foo", "vendor.com/class"),
        ("1vendor.com/foo", "start with a letter"),
        ("vendor.com/-foo", "start with a letter"),
        ("vendor.com/foo-", "end with a letter or digit"),
        ("vendor com/foo", "may only contain"),
    ],
)
def test_invalid_kinds_name_the_rule(kind: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        validate_kind(kind)


@pytest.mark.parametrize("name", ["0", "gpu0", "GPU-0_a.b", "w0::1", "0000:3b:00.0"])
def test_valid_device_names_are_accepted(name: str) -> None:
    validate_device_name(name)
    assert cdi_name(KIND, name) == f"{KIND}={name}"


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "empty"),
        ("-a", "start and end"),
        ("a.", "start and end"),
        ("a b", "may only contain"),
        ("a/b", "may only contain"),
        ("a=b", "may only contain"),
        ("güp", "may only contain"),
    ],
)
def test_invalid_device_names_name_the_rule(name: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        validate_device_name(name)
    with pytest.raises(ValueError, match=rule):
        cdi_name(KIND, name)


def test_default_file_name_is_vendor_dash_class() -> None:
    assert spec_file_name("acme.com/widget") == "acme.com-widget.json"


# ----------------------------------------------------------------------------- the spec


def test_spec_json_has_each_devices_nodes_mounts_and_env() -> None:
    devices = [
        Device(
            "w0",
            device_nodes=(DeviceNode("/dev/widget0"), DeviceNode("/dev/wctl", permissions="r")),
            mounts=(Mount("/opt/acme/lib", "/usr/lib/acme", read_only=True), Mount("/var/acme")),
            env={"ACME_WIDGET": "w0", "ACME_MODE": "a=b"},
        ),
        Device("w1", device_nodes=(DeviceNode("/dev/widget1"),)),
    ]
    spec = CdiSpec.from_devices(KIND, devices)
    assert spec.to_dict() == {
        "cdiVersion": "0.3.0",
        "kind": KIND,
        "devices": [
            {
                "name": "w0",
                "containerEdits": {
                    "env": ["ACME_WIDGET=w0", "ACME_MODE=a=b"],
                    "deviceNodes": [
                        {"path": "/dev/widget0", "permissions": "rw"},
                        {"path": "/dev/wctl", "permissions": "r"},
                    ],
                    "mounts": [
                        {
                            "hostPath": "/opt/acme/lib",
                            "containerPath": "/usr/lib/acme",
                            "options": ["rbind", "ro"],
                        },
                        {
                            "hostPath": "/var/acme",
                            "containerPath": "/var/acme",
                            "options": ["rbind"],
                        },
                    ],
                },
            },
            {
                "name": "w1",
                "containerEdits": {"deviceNodes": [{"path": "/dev/widget1", "permissions": "rw"}]},
            },
        ],
    }
    assert spec.qualified("w1") == "acme.com/widget=w1"


def test_common_edits_are_written_at_spec_level() -> None:
    spec = CdiSpec(
        KIND,
        {"w0": Allocation(env={"A": "1"})},
        common=Allocation(mounts=(Mount("/opt/acme"),)),
    )
    assert spec.to_dict()["containerEdits"] == {
        "mounts": [{"hostPath": "/opt/acme", "containerPath": "/opt/acme", "options": ["rbind"]}]
    }


@pytest.mark.parametrize(
    ("kind", "device", "version"),
    [
        (KIND, Device("w0", device_nodes=(DeviceNode("/dev/w0"),)), "0.3.0"),
        # hostPath only appears when the container path differs: a 0.5.0 field.
        (KIND, Device("w0", device_nodes=(DeviceNode("/dev/w0", "/dev/acme"),)), "0.5.0"),
        # Device names starting with a digit: 0.5.0.
        (KIND, Device("0", device_nodes=(DeviceNode("/dev/w0"),)), "0.5.0"),
        # A dot in the class: 0.6.0.
        ("acme.com/widget.v2", Device("w0", device_nodes=(DeviceNode("/dev/w0"),)), "0.6.0"),
    ],
)
def test_cdi_version_is_the_oldest_that_supports_the_spec(
    kind: str, device: Device, version: str
) -> None:
    spec = CdiSpec.from_devices(kind, [device])
    assert spec.cdi_version == version
    assert spec.to_dict()["cdiVersion"] == version


def test_host_path_is_written_when_it_differs() -> None:
    spec = CdiSpec.from_devices(
        KIND, [Device("w0", device_nodes=(DeviceNode("/dev/w0", "/dev/x"),))]
    )
    node = spec.to_dict()["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node == {"path": "/dev/x", "hostPath": "/dev/w0", "permissions": "rw"}


def test_devices_without_edits_are_left_out() -> None:
    spec = CdiSpec.from_devices(KIND, [Device("bare"), *widgets(1)])
    assert list(spec.devices) == ["w0"]


def test_env_can_be_left_out_of_the_spec() -> None:
    devices = [
        Device("w0", device_nodes=(DeviceNode("/dev/w0"),), env={"A": "1"}),
        Device("e", env={"B": "2"}),
    ]
    spec = CdiSpec.from_devices(KIND, devices, env=False)
    assert list(spec.devices) == ["w0"]
    assert "env" not in spec.to_dict()["devices"][0]["containerEdits"]


def test_replicas_are_separate_cdi_devices() -> None:
    spec = CdiSpec.from_devices(KIND, replicate(widgets(1), 2))
    assert list(spec.devices) == ["w0::0", "w0::1"]


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        (Allocation(), "no device nodes, mounts or env"),
        (Allocation(env={"A=B": "1"}), "invalid environment variable name"),
        (Allocation(env={"": "1"}), "invalid environment variable name"),
        (Allocation(env={"A": "1"}, annotations={"k": "v"}), "annotations and CDI names"),
        (Allocation(env={"A": "1"}, cdi_devices=("x.com/y=z",)), "annotations and CDI names"),
    ],
)
def test_invalid_edits_are_refused(edits: Allocation, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CdiSpec(KIND, {"w0": edits})


def test_device_id_that_is_no_cdi_name_is_refused() -> None:
    with pytest.raises(ValueError, match="device 'w 0' cannot be a CDI device"):
        CdiSpec.from_devices(KIND, [Device("w 0", device_nodes=(DeviceNode("/dev/w0"),))])


# ----------------------------------------------------------------------------- files


def test_write_spec_writes_a_readable_json_file(tmp_path: Path) -> None:
    spec = CdiSpec.from_devices(KIND, widgets(2))
    path = write_spec(spec, tmp_path / "cdi")
    assert path == tmp_path / "cdi" / "acme.com-widget.json"
    assert json.loads(path.read_text()) == spec.to_dict()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["acme.com-widget.json"]


def test_write_spec_takes_a_file_name(tmp_path: Path) -> None:
    spec = CdiSpec.from_devices(KIND, widgets(1))
    assert write_spec(spec, tmp_path, "node-a").name == "node-a.json"
    assert write_spec(spec, tmp_path, "other.json").name == "other.json"


@pytest.mark.parametrize("name", ["../x.json", "sub/x.json", ".hidden.json", "x.yaml"])
def test_write_spec_refuses_bad_file_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="CDI spec file"):
        write_spec(CdiSpec.from_devices(KIND, widgets(1)), tmp_path, name)
    assert list(tmp_path.iterdir()) == []


def test_write_spec_refuses_an_empty_spec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no devices"):
        write_spec(CdiSpec(KIND), tmp_path)


def test_write_spec_replaces_the_file_without_exposing_a_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = CdiSpec.from_devices(KIND, widgets(1))
    new = CdiSpec.from_devices(KIND, widgets(3))
    path = write_spec(old, tmp_path)
    old_inode = path.stat().st_ino
    seen: list[tuple[dict[str, Any], list[str]]] = []
    real_fsync = os.fsync

    def spying_fsync(fd: int) -> None:
        # While the new bytes are being flushed, what would a runtime scanning the dir see?
        visible = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".json", ".yaml"))
        seen.append((json.loads(path.read_text()), visible))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spying_fsync)
    write_spec(new, tmp_path)
    assert seen, "write_spec never fsynced"
    # Before the rename: the complete old spec, and no other spec-looking file.
    assert seen[0] == (old.to_dict(), ["acme.com-widget.json"])
    assert json.loads(path.read_text()) == new.to_dict()
    assert path.stat().st_ino != old_inode  # replaced by rename, not rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == ["acme.com-widget.json"]


def test_failed_write_keeps_the_old_spec_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = CdiSpec.from_devices(KIND, widgets(1))
    path = write_spec(old, tmp_path)

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_spec(CdiSpec.from_devices(KIND, widgets(3)), tmp_path)
    assert json.loads(path.read_text()) == old.to_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["acme.com-widget.json"]


def test_unchanged_spec_is_not_rewritten(tmp_path: Path) -> None:
    spec = CdiSpec.from_devices(KIND, widgets(2))
    path = write_spec(spec, tmp_path)
    inode = path.stat().st_ino
    write_spec(CdiSpec.from_devices(KIND, widgets(2)), tmp_path)
    assert path.stat().st_ino == inode


def test_remove_spec_removes_the_file_once(tmp_path: Path) -> None:
    path = write_spec(CdiSpec.from_devices(KIND, widgets(1)), tmp_path)
    assert remove_spec(path) is True
    assert not path.exists()
    assert remove_spec(path) is False


# ----------------------------------------------------------------------------- the wrapper


class JoiningPlugin(StaticPlugin):
    """Like the rdma backend: allocate() names every allocated device in one variable."""

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        merged = Allocation.merge(devices)
        return Allocation(
            device_nodes=merged.device_nodes,
            mounts=(*merged.mounts, Mount("/run/acme/session", read_only=True)),
            env={**merged.env, "ACME_DEVICES": ",".join(d.id for d in devices)},
            annotations={"acme.com/allocated": str(len(devices))},
        )


class PolledPlugin(StaticPlugin):
    def __init__(self, devices: Sequence[Device]) -> None:
        super().__init__(KIND, devices)
        self.health: dict[str, Health] = {}

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        return dict(self.health)

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        return sorted(d.id for d in available)[-size:]


def env_widgets(count: int) -> list[Device]:
    return [
        Device(
            f"w{i}",
            device_nodes=(DeviceNode(f"/dev/widget{i}"),),
            env={"ACME_DEVICES": f"w{i}"},
        )
        for i in range(count)
    ]


async def test_allocate_returns_cdi_names_resolvable_in_the_written_spec(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    plugin = use_cdi(StaticPlugin(KIND, widgets(4)), directory=tmp_path)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 4)
        got = await kubelet.allocate(KIND, 2)
        specs = spec_devices(tmp_path / "acme.com-widget.json")
        assert sorted(got.allocation.cdi_devices) == sorted(f"{KIND}={i}" for i in got.device_ids)
        for name in got.allocation.cdi_devices:
            device_id = name.split("=", 1)[1]
            assert specs[name]["deviceNodes"] == [
                {"path": f"/dev/widget{device_id[1:]}", "permissions": "rw"}
            ]
        # The container's nodes come from the spec now, not from the Allocate response.
        assert got.allocation.device_nodes == ()
        assert got.allocation.env == {}
    assert not (tmp_path / "acme.com-widget.json").exists()


async def test_rescan_rewrites_the_spec_before_the_kubelet_sees_the_devices(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    inner = StaticPlugin(KIND, widgets(2))
    plugin = use_cdi(inner, directory=tmp_path)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 2)
        inner.set_devices(widgets(3)[1:])
        await kubelet.wait_for(lambda: set(kubelet.devices(KIND)) == {"w1", "w2"})
        assert set(spec_devices(plugin.spec_path)) == {f"{KIND}=w1", f"{KIND}=w2"}
        inner.set_devices([Device("bare")])
        await kubelet.wait_for(lambda: set(kubelet.devices(KIND)) == {"bare"})
        # No device has container edits: CDI forbids an empty spec, so the file goes.
        assert not plugin.spec_path.exists()
        got = await kubelet.allocate(KIND, 1)
        assert got.allocation == Allocation()


async def test_spec_can_outlive_the_plugin(kubelet: FakeKubelet, tmp_path: Path) -> None:
    plugin = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path, remove_on_exit=False)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 1)
    assert set(spec_devices(plugin.spec_path)) == {f"{KIND}=w0"}


async def test_allocation_extras_beyond_the_spec_are_passed_through(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    plugin = use_cdi(JoiningPlugin(KIND, env_widgets(3)), directory=tmp_path, spec_env=False)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 3)
        got = await kubelet.allocate(KIND, 2)
        assert set(got.allocation.env) == {"ACME_DEVICES"}
        assert sorted(got.allocation.env["ACME_DEVICES"].split(",")) == sorted(got.device_ids)
        assert got.allocation.mounts == (Mount("/run/acme/session", read_only=True),)
        assert got.allocation.device_nodes == ()
        assert got.allocation.annotations == {"acme.com/allocated": "2"}
        assert len(got.allocation.cdi_devices) == 2
        # spec_env=False: the spec carries nodes only.
        assert all("env" not in edits for edits in spec_devices(plugin.spec_path).values())


async def test_env_declared_in_the_spec_is_not_repeated_in_allocate(tmp_path: Path) -> None:
    plugin = use_cdi(JoiningPlugin(KIND, env_widgets(2)), directory=tmp_path, spec_env=True)
    devices = list(await plugin.discover())
    one = await plugin.allocate(devices[:1])
    # One device: the allocation's ACME_DEVICES equals the spec's, so only CDI names remain.
    assert one.env == {}
    assert one.cdi_devices == (f"{KIND}=w0",)
    both = await plugin.allocate(devices)
    # Two devices: the joined value conflicts with the spec's; the spec's is used (and logged).
    assert both.env == {}
    assert spec_devices(plugin.spec_path)[f"{KIND}=w1"]["env"] == ["ACME_DEVICES=w1"]
    await plugin.on_stop()


async def test_wrapped_hooks_keep_their_kubelet_options_and_health(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    inner = PolledPlugin(widgets(3))
    plugin = use_cdi(inner, directory=tmp_path)
    assert plugin.overrides("preferred_allocation")
    assert not plugin.overrides("pre_start_container")
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 3)
        registration = kubelet.successful_registrations(KIND)[0]
        assert registration.preferred_allocation
        assert not registration.pre_start_required
        inner.health["w0"] = Health.UNHEALTHY
        await kubelet.wait_for_health(KIND, "w0", "Unhealthy")
        got = await kubelet.allocate(KIND, 1)
        assert got.preferred == ("w2",)
        assert got.allocation.cdi_devices == (f"{KIND}=w2",)


def test_the_wrapper_declares_that_its_allocate_is_no_plain_merge(tmp_path: Path) -> None:
    """The servicer keeps merged answers only for a plain merge; CDI's adds CDI names, even
    around a plugin that keeps the default allocate (and says so through ``overrides``)."""
    inner = StaticPlugin(KIND, widgets(1))
    assert inner.allocate_is_merge
    assert not JoiningPlugin(KIND, env_widgets(1)).allocate_is_merge
    plugin = use_cdi(inner, directory=tmp_path)
    assert not plugin.overrides("allocate")
    assert not plugin.allocate_is_merge


async def test_device_id_that_is_no_cdi_name_fails_discovery(tmp_path: Path) -> None:
    plugin = use_cdi(
        StaticPlugin(KIND, [Device("w 0", device_nodes=(DeviceNode("/dev/w0"),))]),
        directory=tmp_path,
    )
    with pytest.raises(BackendError, match="'w 0' cannot be a CDI device"):
        await plugin.discover()
    assert os.listdir(tmp_path) == []


def test_kind_defaults_to_the_resource_name(tmp_path: Path) -> None:
    plugin = use_cdi(StaticPlugin("example.com/dev", widgets(1)), directory=tmp_path)
    assert isinstance(plugin, CdiPlugin)
    assert plugin.kind == "example.com/dev"
    assert plugin.resource_name == "example.com/dev"
    assert plugin.spec_path == tmp_path / "example.com-dev.json"


def test_bad_kind_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="start with a letter"):
        use_cdi(StaticPlugin(KIND, widgets(1)), "acme.com/1x", directory=tmp_path)


def test_wrapping_twice_is_refused(tmp_path: Path) -> None:
    plugin = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    with pytest.raises(TypeError, match="already uses CDI"):
        use_cdi(plugin)


class FlakyWatchPlugin(StaticPlugin):
    """Its event source fails once, then works."""

    def __init__(self, devices: Sequence[Device]) -> None:
        super().__init__(KIND, devices)
        self.watch_calls = 0

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        self.watch_calls += 1
        if self.watch_calls == 1:
            raise RuntimeError("event source lost")
        async for event in super().watch():
            yield event


async def test_failing_wrapped_watch_keeps_the_spec_and_is_restarted(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    inner = FlakyWatchPlugin(widgets(2))
    plugin = use_cdi(inner, directory=tmp_path)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 2)
        await kubelet.wait_for(lambda: inner.watch_calls >= 2, what="watch() restarted")
        assert set(spec_devices(plugin.spec_path)) == {f"{KIND}=w0", f"{KIND}=w1"}
        inner.set_devices(widgets(3))  # the restarted watch() still reaches the SDK
        await kubelet.wait_for_allocatable(KIND, 3)
        assert f"{KIND}=w2" in spec_devices(plugin.spec_path)
    assert not plugin.spec_path.exists()


async def test_env_goes_through_allocate_by_default_when_the_plugin_allocates_itself(
    tmp_path: Path,
) -> None:
    joining = use_cdi(JoiningPlugin(KIND, env_widgets(2)), directory=tmp_path / "a")
    merging = use_cdi(StaticPlugin(KIND, env_widgets(2)), directory=tmp_path / "b")
    assert (joining.spec_env, merging.spec_env) == (False, True)
    devices = list(await joining.discover())
    await merging.discover()
    assert all("env" not in e for e in spec_devices(joining.spec_path).values())
    assert spec_devices(merging.spec_path)[f"{KIND}=w1"]["env"] == ["ACME_DEVICES=w1"]
    got = await joining.allocate(devices)
    assert got.env == {"ACME_DEVICES": "w0,w1"}
    assert (await merging.allocate(devices)).env == {}
    await joining.on_stop()
    await merging.on_stop()


def test_fingerprint_follows_the_wrapped_plugin_and_the_cdi_settings(tmp_path: Path) -> None:
    def make(kind: str = KIND, resource: str = KIND) -> CdiPlugin:
        return use_cdi(StaticPlugin(resource, widgets(1)), kind, directory=tmp_path)

    # Equal configurations compare equal across instances (a reload keeps the resource running).
    assert make().fingerprint() == make().fingerprint()
    assert make().fingerprint() != make(kind="acme.com/other").fingerprint()
    assert make().fingerprint() != make(resource="acme.com/x").fingerprint()


# ----------------------------------------------------------------------------- ownership


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def test_second_plugin_for_a_spec_path_writes_and_removes_nothing(tmp_path: Path) -> None:
    first = use_cdi(StaticPlugin(KIND, widgets(2)), directory=tmp_path)
    assert [d.id for d in await first.discover()] == ["w0", "w1"]
    before = first.spec_path.read_bytes()
    inode = first.spec_path.stat().st_ino
    # Another instance, configured differently, for the same spec file (as a second DaemonSet
    # pod would be): it may not write it, so its CDI devices are not advertised...
    second = use_cdi(StaticPlugin(KIND, [*widgets(3), Device("bare")]), directory=tmp_path)
    assert [d.id for d in await second.discover()] == ["bare"]
    assert second.names == {}
    # ...and its shutdown leaves the first one's spec alone.
    await second.on_stop()
    assert first.spec_path.read_bytes() == before
    assert first.spec_path.stat().st_ino == inode
    assert (await first.allocate(list(await first.discover()))).cdi_devices == (
        f"{KIND}=w0",
        f"{KIND}=w1",
    )
    await first.on_stop()
    assert listing(tmp_path) == []  # the spec and its lock file


async def test_the_next_plugin_owns_the_spec_once_the_first_stops(tmp_path: Path) -> None:
    first = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    await first.discover()
    second = use_cdi(StaticPlugin(KIND, widgets(2)), directory=tmp_path)
    assert await second.discover() == []
    await first.on_stop()
    assert [d.id for d in await second.discover()] == ["w0", "w1"]
    assert set(spec_devices(second.spec_path)) == {f"{KIND}=w0", f"{KIND}=w1"}
    await second.on_stop()
    assert listing(tmp_path) == []


async def test_a_plugin_whose_lock_file_was_removed_gives_way(tmp_path: Path) -> None:
    first = use_cdi(StaticPlugin(KIND, widgets(2)), directory=tmp_path)
    await first.discover()
    (tmp_path / ".acme.com-widget.json.lock").unlink()  # by hand, while first serves
    second = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    assert len(await second.discover()) == 1
    # Never two owners: first finds its lock gone and a new holder, and no longer trusts the
    # file to hold its names.
    assert await first.discover() == []
    assert first.names == {}
    await first.on_stop()
    assert set(spec_devices(second.spec_path)) == {f"{KIND}=w0"}
    await second.on_stop()
    assert listing(tmp_path) == []


def replace_by_rename(path: Path) -> None:
    other = path.with_name("incoming")
    other.write_text('{"kind": "acme.com/widget", "devices": []}')
    os.replace(other, path)


def rewrite_in_place(path: Path) -> None:
    with path.open("r+b") as f:  # same inode, other bytes
        f.write(b" ")


@pytest.mark.parametrize("change", [replace_by_rename, rewrite_in_place])
async def test_spec_another_writer_changed_is_left_in_place(
    tmp_path: Path, change: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    await plugin.discover()
    change(plugin.spec_path)
    changed = plugin.spec_path.read_bytes()
    with caplog.at_level(logging.INFO, logger="devplugin_sdk"):
        await plugin.on_stop()
    assert plugin.spec_path.read_bytes() == changed
    assert listing(tmp_path) == ["acme.com-widget.json"]
    assert "replaced by another writer; left in place" in caplog.text


async def test_spec_left_by_an_earlier_run_with_the_same_bytes_is_adopted(tmp_path: Path) -> None:
    path = write_spec(CdiSpec.from_devices(KIND, widgets(2)), tmp_path)
    inode = path.stat().st_ino
    plugin = use_cdi(StaticPlugin(KIND, widgets(2)), directory=tmp_path)
    assert len(await plugin.discover()) == 2
    assert path.stat().st_ino == inode  # not rewritten...
    await plugin.on_stop()
    assert listing(tmp_path) == []  # ...but ours to remove


async def test_stale_temporary_files_are_removed_when_the_plugin_takes_the_spec(
    tmp_path: Path,
) -> None:
    ours = [".acme.com-widget.0a1b2c3d.tmp", ".acme.com-widget.x_y0z9ab.tmp"]  # hex; mkstemp's
    others = [
        ".acme.com-widget.v2.0a1b2c3d.tmp",  # the temporary file of another spec
        ".acme.com-widget.0a1b2c3d.json",
        "acme.com-widget.0a1b2c3d.tmp",
        "notes.tmp",
    ]
    for name in [*ours, *others]:
        (tmp_path / name).write_text('{"kind": "acme.com/wid')  # cut short by a SIGKILL
    (tmp_path / ".acme.com-widget.deadbeef.tmp").mkdir()  # not a file: not ours
    owner = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    await owner.discover()
    # A second instance finds a temporary file (the owner's write in flight) and keeps off it.
    in_flight = tmp_path / ".acme.com-widget.11111111.tmp"
    in_flight.write_text("{")
    second = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    await second.discover()
    await second.on_stop()
    assert in_flight.exists()
    in_flight.unlink()
    assert listing(tmp_path) == sorted(
        [
            *others,
            ".acme.com-widget.deadbeef.tmp",
            ".acme.com-widget.json.lock",
            "acme.com-widget.json",
        ]
    )
    await owner.on_stop()


# ----------------------------------------------------------------------------- hostile paths


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes read through os.read by path, for every path os.open opened."""
    real_open, real_read, real_close = os.open, os.read, os.close
    paths: dict[int, str] = {}
    read: dict[str, int] = {}

    def spying_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        paths[fd] = os.fspath(path)
        read.setdefault(os.fspath(path), 0)
        return fd

    def spying_read(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        if fd in paths:
            read[paths[fd]] += len(data)
        return data

    def spying_close(fd: int) -> None:
        paths.pop(fd, None)
        real_close(fd)

    monkeypatch.setattr(os, "open", spying_open)
    monkeypatch.setattr(os, "read", spying_read)
    monkeypatch.setattr(os, "close", spying_close)
    return read


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def link_to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def make_dev_zero(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


def link_to_a_file_with_the_same_bytes(path: Path) -> None:
    target = path.with_name("elsewhere")
    target.write_bytes(CdiSpec.from_devices(KIND, widgets(2)).to_json())
    path.symlink_to(target)


def make_dir(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    "plant", [make_fifo, link_to_dev_zero, make_dev_zero, link_to_a_file_with_the_same_bytes]
)
def test_spec_path_that_is_no_regular_file_is_replaced_without_being_opened(
    tmp_path: Path, plant: Any, opened: dict[str, int]
) -> None:
    spec = CdiSpec.from_devices(KIND, widgets(2))
    path = tmp_path / "acme.com-widget.json"
    plant(path)
    assert write_spec(spec, tmp_path) == path  # a FIFO would block, /dev/zero never end
    assert str(path) not in opened
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert json.loads(path.read_text()) == spec.to_dict()
    if (tmp_path / "elsewhere").exists():  # a link's target is not written through
        assert (tmp_path / "elsewhere").read_bytes() == spec.to_json()


def test_a_huge_file_at_the_spec_path_is_replaced_unread(
    tmp_path: Path, opened: dict[str, int]
) -> None:
    path = tmp_path / "acme.com-widget.json"
    with path.open("wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros that takes no room
    spec = CdiSpec.from_devices(KIND, widgets(2))
    write_spec(spec, tmp_path)
    assert opened.get(str(path), 0) == 0
    assert path.read_bytes() == spec.to_json()


def test_a_file_of_the_specs_size_is_read_no_further(
    tmp_path: Path, opened: dict[str, int]
) -> None:
    spec = CdiSpec.from_devices(KIND, widgets(2))
    path = tmp_path / "acme.com-widget.json"
    path.write_bytes(b"x" * len(spec.to_json()))
    write_spec(spec, tmp_path)
    assert opened[str(path)] <= len(spec.to_json())
    assert path.read_bytes() == spec.to_json()


async def test_a_directory_at_the_spec_path_holds_the_devices_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = use_cdi(StaticPlugin(KIND, widgets(2)), directory=tmp_path)
    (tmp_path / "acme.com-widget.json").mkdir()
    assert await plugin.discover() == []
    assert "cannot write CDI spec" in caplog.text
    (tmp_path / "acme.com-widget.json").rmdir()
    assert len(await plugin.discover()) == 2
    await plugin.on_stop()


@pytest.mark.parametrize("plant", [make_fifo, link_to_dev_zero])
async def test_lock_path_that_is_no_regular_file_is_refused_unopened(
    tmp_path: Path, plant: Any, opened: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    lock = tmp_path / ".acme.com-widget.json.lock"
    plant(lock)
    plugin = use_cdi(StaticPlugin(KIND, widgets(2)), directory=tmp_path)
    assert await plugin.discover() == []
    assert str(lock) not in opened
    assert "not a regular file, is in the way of the CDI spec's lock file" in caplog.text
    await plugin.on_stop()
    assert listing(tmp_path) == [lock.name]


# ----------------------------------------------------------------------------- failed writes


class FullDisk:
    """os.fsync of a spec's temporary file fails with ENOSPC while ``full`` is set (only in the
    spec directory: the fake kubelet fsyncs its checkpoint elsewhere)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self.full = False
        self.refused = 0
        self._lock = threading.Lock()
        real_fsync = os.fsync

        def in_directory(fd: int) -> bool:
            return Path(os.readlink(f"/proc/self/fd/{fd}")).parent == directory

        def fsync(fd: int) -> None:
            if self.full and stat.S_ISREG(os.fstat(fd).st_mode) and in_directory(fd):
                with self._lock:
                    self.refused += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FullDisk:
    return FullDisk(monkeypatch, tmp_path)


async def test_new_devices_wait_for_a_failed_write_and_come_once_a_retry_writes_it(
    kubelet: FakeKubelet, tmp_path: Path, disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="devplugin_sdk")
    inner = StaticPlugin(KIND, widgets(2))
    plugin = use_cdi(inner, directory=tmp_path)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(KIND, 2)
        disk.full = True
        inner.set_devices(widgets(3))
        # The first write and two retries fail; the kubelet never hears of w2.
        await kubelet.wait_for(lambda: disk.refused >= 3, what="two retries")
        assert set(kubelet.devices(KIND)) == {"w0", "w1"}
        assert set(spec_devices(plugin.spec_path)) == {f"{KIND}=w0", f"{KIND}=w1"}
        assert listing(tmp_path) == [".acme.com-widget.json.lock", "acme.com-widget.json"]
        # The devices the old spec holds keep working meanwhile, health included.
        inner.set_health("w1", Health.UNHEALTHY)
        await kubelet.wait_for_health(KIND, "w1", "Unhealthy")
        got = await kubelet.allocate(KIND, 1)
        assert got.allocation.cdi_devices == (f"{KIND}=w0",)
        disk.full = False
        await kubelet.wait_for(lambda: set(kubelet.devices(KIND)) == {"w0", "w1", "w2"})
        assert f"{KIND}=w2" in spec_devices(plugin.spec_path)
    assert caplog.text.count(os.strerror(errno.ENOSPC)) == 1  # the same failure, logged once
    assert re.search(r"CDI spec \S+ written after [3-9] failed attempts", caplog.text)


async def test_first_discovery_survives_a_failed_write_and_serves_once_written(
    kubelet: FakeKubelet, tmp_path: Path, disk: FullDisk
) -> None:
    disk.full = True
    plugin = use_cdi(StaticPlugin(KIND, [*widgets(2), Device("bare")]), directory=tmp_path)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for(lambda: disk.refused >= 2, what="a retry")
        # Registered, with only the device that needs no spec.
        assert set(kubelet.devices(KIND)) == {"bare"}
        assert not plugin.spec_path.exists()
        disk.full = False
        await kubelet.wait_for_allocatable(KIND, 3)
        assert set(spec_devices(plugin.spec_path)) == {f"{KIND}=w0", f"{KIND}=w1"}
    assert listing(tmp_path) == []


async def test_device_whose_edits_could_not_be_written_is_held_back(
    tmp_path: Path, disk: FullDisk
) -> None:
    inner = StaticPlugin(KIND, widgets(2))
    plugin = use_cdi(inner, directory=tmp_path)
    await plugin.discover()
    moved = Device("w1", device_nodes=(DeviceNode("/dev/widget9"),))
    inner.set_devices([widgets(1)[0], moved])
    disk.full = True
    # The spec still gives w1 its old node: the kubelet must not hand w1 out meanwhile.
    assert [d.id for d in await plugin.discover()] == ["w0"]
    disk.full = False
    assert [d.id for d in await plugin.discover()] == ["w0", "w1"]
    assert spec_devices(plugin.spec_path)[f"{KIND}=w1"]["deviceNodes"][0]["path"] == "/dev/widget9"
    await plugin.on_stop()


async def test_stopping_before_any_discovery_is_harmless(tmp_path: Path) -> None:
    plugin = use_cdi(StaticPlugin(KIND, widgets(1)), directory=tmp_path)
    await plugin.on_stop()
    assert listing(tmp_path) == []
