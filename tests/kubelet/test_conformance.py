"""devplugin conformance: our own plugins pass every check; each deliberate fault gets its level."""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import anyio
import pytest
from broken_plugins import (
    FAULTS,
    LONG_ID,
    REGISTER_FAULTS,
    run_registered,
    serve_not_grpc,
    serving_raw,
)
from sdk_helpers import EXAMPLES, ROOT, load_example

from devplugin_sdk import Device, DeviceNode, DevicePlugin, Mount, Settings
from devplugin_sdk.kubelet import _cli_probe
from devplugin_sdk.kubelet.conformance import (
    CHECKS,
    RESTART_CHECK,
    RESTART_KUBELET,
    ConformanceError,
    ConformanceReport,
    Limits,
    check_register_dir,
    check_socket,
)
from devplugin_sdk.testing import FakeKubelet, serving

RESOURCE = "acme.com/widget"
# Short waits for the faults that make a check wait for a message that never comes.
LIMITS = Limits(timeout=1.0, settle=0.0, restart_timeout=5.0)
SOCKET_CHECKS = [c.name for c in CHECKS if not c.register_only]
DOCS = ROOT / "docs"
# What the line of each fault's target check must say.
FAULT_MESSAGES = {
    "slow-options": "over 200.0 ms; the kubelet calls it inside Register",
    "no-initial-list": "no ListAndWatch message within 1 s",
    "oversized-list": "over the kubelet's 4 MiB receive limit",
    "duplicate-ids": "ID 'dev-0' is listed 2 times",
    "long-id": f"ID {LONG_ID[:24]!r}... is 74 characters",
    "lowercase-health": "device 'dev-odd' has health 'healthy'",
    "negative-numa": "device 'dev-far' reports NUMA nodes [-1]",
    "one-device-fails": "Allocate([['dev-5']]): Allocate failed: INTERNAL: /dev/dev-5: no such file",
    "not-idempotent": "FAILED_PRECONDITION: already allocated",
    "first-container-only": "answered 1 container responses for 4 container requests",
    "refuses-combinations": "is refused (at most 2 devices per container); each device alone is "
    "allocated again, so the refusal is of the combination",
    "no-container-response": "answered no container response; the kubelet fails the pod",
    "extra-container-response": "answered 2 container responses for 1 container request; "
    "the kubelet reads only the first",
    "accepts-unknown": "Allocate accepted unknown ID 'conformance-unknown-1'",
    "preferred-fails": "GetPreferredAllocation failed: INTERNAL: topology not read yet",
    "preferred-ignores-request": "left out must-include ID 'dev-5'",
    "preferred-wrong-size": "GetPreferredAllocation(size=1, must_include=[], 6 available) "
    "returned 2 IDs",
    "preferred-unavailable": "returned 'dev-sick', which is not available",
    "prestart-unimplemented": "PreStartContainer failed: UNIMPLEMENTED",
    "single-stream": "a second concurrent ListAndWatch stream got no message within 1 s",
    "ends-stream": "the first ListAndWatch stream ended: the plugin ended the ListAndWatch stream",
    "dies-on-disconnect": "after a client disconnected mid-stream the plugin stopped serving",
}
REGISTER_CHECKS = [c.name for c in CHECKS] + [RESTART_CHECK]


class Widgets(DevicePlugin):
    """An SDK plugin with every optional RPC, so that no check is skipped."""

    resource_name = RESOURCE

    async def discover(self) -> Sequence[Device]:
        return [
            Device(
                f"w{i}",
                numa_nodes=(i % 2,),
                device_nodes=(DeviceNode(f"/dev/widget{i}"),),
                mounts=(Mount("/opt/widget", read_only=True),),
                env={"WIDGET_VISIBLE": str(i)},
            )
            for i in range(4)
        ]

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        return [d.id for d in reversed(available)][:size]

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        return None


def settings(directory: Path) -> Settings:
    return Settings(
        device_plugin_dir=directory,
        register_backoff_initial=0.02,
        register_backoff_max=0.2,
        restart_poll_interval=0.5,
        reregister_delay=0.05,
        stop_grace=0.2,
    )


def failed(report: ConformanceReport) -> set[str]:
    return {r.name for r in report.results if r.status == "fail"}


def judged(report: ConformanceReport) -> dict[str, str]:
    """The checks that failed or warned, with their level."""
    return {r.name: r.status for r in report.results if r.status in ("fail", "warn")}


def by_name(report: ConformanceReport) -> Mapping[str, str]:
    return {r.name: r.status for r in report.results}


async def register_dir_run(directory: Path, *plugins: DevicePlugin) -> ConformanceReport:
    """Run --register-dir against SDK plugins started beside it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_forever, plugins, settings(directory))
        report = await check_register_dir(directory, LIMITS)
        tg.cancel_scope.cancel()
    return report


async def _serve_forever(plugins: Sequence[DevicePlugin], plugin_settings: Settings) -> None:
    async with serving(*plugins, settings=plugin_settings):
        await anyio.sleep_forever()


# ------------------------------------------------------------------------------------------ socket


async def test_sdk_plugin_passes_every_check_on_its_socket(kubelet: FakeKubelet) -> None:
    async with serving(Widgets(), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        seen: list[str] = []
        report = await check_socket(
            kubelet.directory / "acme.com_widget.sock", LIMITS, lambda r: seen.append(r.line())
        )
    assert [r.name for r in report.results] == SOCKET_CHECKS
    assert judged(report) == {}, "\n".join(seen)
    assert report.count("skip") == 0
    assert report.succeeded(strict=True)
    assert report.summary() == f"{len(SOCKET_CHECKS)} passed, 0 failed"
    assert seen[0].startswith("PASS  dial  connected in ")


async def test_raw_plugin_without_a_fault_passes_every_check(short_dir: Path) -> None:
    async with serving_raw(short_dir / "raw.sock"):
        report = await check_socket(short_dir / "raw.sock", LIMITS)
    assert judged(report) == {}, [r.line() for r in report.results]
    assert report.count("skip") == 0


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_each_fault_gets_its_level_from_its_check_and_only_its_consequences(
    short_dir: Path, fault: str
) -> None:
    limits = LIMITS
    if fault == "slow-options":
        limits = Limits(timeout=LIMITS.timeout, fast_within=0.2)
    async with serving_raw(short_dir / "raw.sock", fault):
        report = await check_socket(short_dir / "raw.sock", limits)
    assert judged(report) == FAULTS[fault], [r.line() for r in report.results]
    [target] = [r for r in report.results if r.name == next(iter(FAULTS[fault]))]
    assert FAULT_MESSAGES[fault] in target.detail
    assert report.ok is ("fail" not in FAULTS[fault].values())
    assert not report.succeeded(strict=True)


async def test_a_plugin_like_the_kubelets_stub_passes_with_a_note(short_dir: Path) -> None:
    """An empty PreferredAllocationResponse is "no preference" to the kubelet."""
    async with serving_raw(short_dir / "raw.sock", "empty-preferred"):
        report = await check_socket(short_dir / "raw.sock", LIMITS)
    [preferred] = [r for r in report.results if r.name == "preferred-allocation"]
    assert judged(report) == {}, [r.line() for r in report.results]
    assert preferred.detail == (
        "4 requests; note: 4 got no preference (an empty answer: the kubelet chooses by itself)"
    )
    assert report.succeeded(strict=True)


def test_every_check_has_a_fault_and_each_level_is_one_its_check_gives() -> None:
    levels = {c.name: set(c.levels) for c in CHECKS} | {RESTART_CHECK: {"fail"}}
    faults = {**FAULTS, **REGISTER_FAULTS}
    assert {next(iter(f)) for f in faults.values()} | {"dial"} == set(levels)
    for fault, judged_as in faults.items():
        for check, level in judged_as.items():
            assert level in levels[check], (fault, check, level)
    assert set(FAULT_MESSAGES) == set(FAULTS)


def test_every_check_cites_the_kubelet_code_and_the_docs_table_does_too() -> None:
    table = (DOCS / "probe-and-conformance.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z-]+)`.*$", table, re.M)}
    cited = {c.name: c.kubelet for c in CHECKS} | {RESTART_CHECK: RESTART_KUBELET}
    for name, text in cited.items():
        functions = re.findall(r"dm/[\w/]+\.go:\w+", text)
        assert functions, name
        assert name in rows, f"{name} is not in the checks table"
        missing = [f for f in functions if f.rsplit(":", 1)[1] not in rows[name]]
        assert not missing, f"{name}: the docs row does not cite {missing}"


async def test_socket_that_is_not_grpc_fails_dial_and_skips_the_rest(short_dir: Path) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(serve_not_grpc, short_dir / "http.sock")
        report = await check_socket(short_dir / "http.sock", LIMITS)
        tg.cancel_scope.cancel()
    assert failed(report) == {"dial"}
    assert "does not speak gRPC" in report.results[0].detail
    assert {r.status for r in report.results[1:]} == {"skip"}
    assert not report.ok


async def test_missing_socket_fails_dial(short_dir: Path) -> None:
    report = await check_socket(short_dir / "nothing.sock", LIMITS)
    assert failed(report) == {"dial"}
    assert "no socket at" in report.results[0].detail


# ------------------------------------------------------------------------------------------ register-dir


async def test_register_dir_passes_sdk_plugin_and_reports_reregistration_time(
    short_dir: Path,
) -> None:
    report = await register_dir_run(short_dir, Widgets())
    assert [r.name for r in report.results] == REGISTER_CHECKS
    assert judged(report) == {}, [r.line() for r in report.results]
    restart = report.results[-1]
    assert restart.status == "pass"
    assert f"{RESOURCE}: registered " in restart.detail
    assert "first list" in restart.detail
    assert {r.resource for r in report.results[:-1]} == {RESOURCE}


async def test_register_dir_tests_every_resource_that_registers(short_dir: Path) -> None:
    limits = Limits(timeout=LIMITS.timeout, expect=2, settle=0.0, restart_timeout=5.0)
    async with anyio.create_task_group() as tg:
        plugins = (Widgets(), Widgets(resource_name="acme.com/gadget"))
        tg.start_soon(_serve_forever, plugins, settings(short_dir))
        report = await check_register_dir(short_dir, limits)
        tg.cancel_scope.cancel()
    assert failed(report) == set(), [r.line() for r in report.results]
    assert {r.resource for r in report.results if r.resource} == {RESOURCE, "acme.com/gadget"}
    assert "acme.com/gadget: registered" in report.results[-1].detail


async def test_register_dir_passes_raw_plugin_without_a_fault(short_dir: Path) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_registered, short_dir, None)
        report = await check_register_dir(short_dir, LIMITS)
        tg.cancel_scope.cancel()
    assert failed(report) == set(), [r.line() for r in report.results]


@pytest.mark.parametrize("fault", sorted(REGISTER_FAULTS))
async def test_register_dir_catches_registration_faults(short_dir: Path, fault: str) -> None:
    limits = Limits(timeout=LIMITS.timeout, settle=0.0, restart_timeout=0.5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_registered, short_dir, fault)
        report = await check_register_dir(short_dir, limits)
        tg.cancel_scope.cancel()
    assert judged(report) == REGISTER_FAULTS[fault], [r.line() for r in report.results]


async def test_subdirectory_endpoint_failure_says_why(short_dir: Path) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_registered, short_dir, "subdir-endpoint")
        report = await check_register_dir(short_dir, LIMITS)
        tg.cancel_scope.cancel()
    [result] = [r for r in report.results if r.name == "registration-valid"]
    assert "endpoint must be a bare socket file name" in result.detail


async def test_register_dir_reports_when_nothing_registers(short_dir: Path) -> None:
    report = await check_register_dir(short_dir, Limits(register_wait=0.2))
    assert [(r.name, r.status) for r in report.results] == [("registration-valid", "fail")]
    assert "nothing registered" in report.results[0].detail


async def test_register_dir_refuses_a_directory_a_live_kubelet_serves(short_dir: Path) -> None:
    async with FakeKubelet(directory=short_dir):
        with pytest.raises(ConformanceError, match="live process"):
            await check_register_dir(short_dir, LIMITS)


# ------------------------------------------------------------------------------------------ backends


def _generic_backend(root: Path) -> list[DevicePlugin]:
    from devplugin_sdk.backends import generic

    dev = root / "host" / "dev"
    dev.mkdir(parents=True)
    for i in range(3):
        (dev / f"ttyACM{i}").touch()
    config = {
        "resources": [{"resourceName": "acme.com/serial", "paths": [f"{dev}/ttyACM*"], "share": 2}]
    }
    return generic.from_config(config)


def _generic_example(root: Path) -> list[DevicePlugin]:
    from devplugin_sdk.backends import generic
    from devplugin_sdk.config import load_yaml

    # What `devplugin run generic --config examples/generic/config.yaml` serves, with its
    # paths moved under root/host.
    (root / "host" / "dev" / "net").mkdir(parents=True)
    for name in ("ttyUSB0", "ttyACM0", "fuse", "net/tun"):
        (root / "host" / "dev" / name).touch()
    config = load_yaml(EXAMPLES / "generic" / "config.yaml")
    for resource in config["resources"]:
        resource["paths"] = [f"{root}/host{path}" for path in resource["paths"]]
    return generic.from_config(config)


def _fpga_example(root: Path, config: str) -> list[DevicePlugin]:
    from devplugin_sdk.config import load_yaml
    from devplugin_sdk.testing import fpga_trees

    make_host = fpga_trees.alveo_u250_host if config == "config.yaml" else fpga_trees.dfl_pac_host
    host, _ = make_host(root / "host")
    options = load_yaml(EXAMPLES / "fpga" / config)
    plugins: list[DevicePlugin] = load_example("fpga").FpgaExamplePlugin.from_config(
        {**options, "sysfsRoot": str(host.sysfs_root), "devRoot": str(host.dev_root)}
    )
    return plugins


def _rdma_backend(root: Path) -> list[DevicePlugin]:
    from devplugin_sdk.backends import rdma
    from devplugin_sdk.testing import rdma_trees

    host = rdma_trees.connectx_host(root / "host")
    config = {
        "sysfsRoot": str(host.sysfs_root),
        "devRoot": str(host.dev_root),
        "resources": [
            {"resourceName": "example.com/ib", "selectors": {"linkTypes": ["infiniband"]}},
            {"resourceName": "example.com/roce", "mode": "shared", "shares": 3},
        ],
    }
    return rdma.from_config(config)


def _rdma_example(root: Path) -> list[DevicePlugin]:
    from devplugin_sdk.cli.runfile import parse_run_config
    from devplugin_sdk.config import load_yaml
    from devplugin_sdk.testing import rdma_trees

    host = rdma_trees.connectx_host(root / "host")
    # What `devplugin run plugin:RdmaExamplePlugin --config config.yaml` serves, re-rooted.
    config = parse_run_config(load_yaml(EXAMPLES / "rdma" / "config.yaml")).backend_options
    roots = {"sysfsRoot": str(host.sysfs_root), "devRoot": str(host.dev_root)}
    plugins: list[DevicePlugin] = load_example("rdma").RdmaExamplePlugin.from_config(
        {**config, **roots}
    )
    return plugins


def _nvml_backend(root: Path) -> list[DevicePlugin]:
    from devplugin_sdk.backends import nvidia
    from devplugin_sdk.testing import fake_nvml

    fake = fake_nvml.a100_mig([("3g.40gb", "1g.10gb", "1g.10gb"), None])
    roots = fake.write_host(root / "host")
    with fake.installed():
        return nvidia.from_config({"migStrategy": "mixed", **roots.config()})


def _nvidia_example(root: Path) -> list[DevicePlugin]:
    import yaml

    from devplugin_sdk.testing import fake_nvml

    fake = fake_nvml.dgx_a100()
    roots = fake.write_host(root / "host")
    config = yaml.safe_load((EXAMPLES / "nvidia" / "config.yaml").read_text())
    with fake.installed():
        plugins: list[DevicePlugin] = load_example("nvidia").SiteGpuPlugin.from_config(
            {**config, **roots.config()}
        )
    return plugins


BACKENDS: dict[str, Callable[[Path], list[DevicePlugin]]] = {
    "generic-backend": _generic_backend,
    "generic-example": _generic_example,
    "fpga-example-xrt": lambda root: _fpga_example(root, "config.yaml"),
    "fpga-example-dfl": lambda root: _fpga_example(root, "config-dfl.yaml"),
    "rdma-backend": _rdma_backend,
    "rdma-example": _rdma_example,
    "nvml-backend-mig-mixed": _nvml_backend,
    "nvidia-example": _nvidia_example,
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
async def test_builtin_backend_passes_every_check(short_dir: Path, backend: str) -> None:
    plugins = BACKENDS[backend](short_dir)
    limits = Limits(timeout=LIMITS.timeout, expect=len(plugins), settle=0.0, restart_timeout=5.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_forever, plugins, settings(short_dir / "dp"))
        report = await check_register_dir(short_dir / "dp", limits)
        tg.cancel_scope.cancel()
    assert judged(report) == {}, [r.line() for r in report.results]
    tested = {r.resource for r in report.results if r.resource}
    assert tested == {p.resource_name for p in plugins}


@pytest.mark.parametrize("config", ["config-gpushare.yaml", "config-hami.yaml"])
async def test_gpu_sharing_configs_pass_with_the_refused_combination_as_a_warning(
    short_dir: Path, config: str
) -> None:
    """Memory units and slices refuse a container asking for every device (it spans GPUs):
    a deliberate refusal, judged a warning once one device alone is allocated again."""
    import yaml

    from devplugin_sdk.testing import fake_nvml

    fake = fake_nvml.dgx_a100_40gb()
    roots = fake.write_host(short_dir / "host")
    data = yaml.safe_load((EXAMPLES / "nvidia" / config).read_text())
    with fake.installed():
        plugins = load_example("nvidia").SiteGpuPlugin.from_config({**data, **roots.config()})
    limits = Limits(timeout=LIMITS.timeout, expect=len(plugins), settle=0.0, restart_timeout=5.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_forever, plugins, settings(short_dir / "dp"))
        report = await check_register_dir(short_dir / "dp", limits)
        tg.cancel_scope.cancel()
    warnings = {(r.resource, r.name) for r in report.results if r.status == "warn"}
    assert report.ok, [r.line() for r in report.results]
    assert warnings, [r.line() for r in report.results]
    assert {name for _, name in warnings} == {"allocate-all-healthy"}, warnings


# ------------------------------------------------------------------------------------------ CLI


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="devplugin")
    _cli_probe.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def test_cli_prints_one_line_per_check_then_the_summary(short_dir: Path) -> None:
    out = io.StringIO()
    async with serving_raw(short_dir / "raw.sock", "accepts-unknown"):
        code = await _cli_probe._conformance(
            parse(["conformance", "--socket", str(short_dir / "raw.sock"), "--timeout", "1"]), out
        )
    lines = out.getvalue().splitlines()
    assert code == 0
    assert len(lines) == len(SOCKET_CHECKS) + 1
    assert (
        "WARN  unknown-ids-rejected  Allocate accepted unknown ID 'conformance-unknown-1'" in lines
    )
    assert lines[-1] == f"{len(SOCKET_CHECKS) - 1} passed, 1 warned, 0 failed"


@pytest.mark.parametrize(("fault", "code"), [("preferred-wrong-size", 1), (None, 0)])
async def test_cli_strict_makes_warnings_fail(
    short_dir: Path, fault: str | None, code: int
) -> None:
    out = io.StringIO()
    argv = ["conformance", "--socket", str(short_dir / "raw.sock"), "--timeout", "1", "--strict"]
    async with serving_raw(short_dir / "raw.sock", fault):
        got = await _cli_probe._conformance(parse(argv), out)
        as_json = io.StringIO()
        await _cli_probe._conformance(parse([*argv, "--json"]), as_json)
    document = json.loads(as_json.getvalue())
    assert got == code
    assert document["strict"] is True
    assert document["ok"] is (code == 0)
    if fault is not None:
        assert out.getvalue().splitlines()[-1] == (
            f"{len(SOCKET_CHECKS) - 1} passed, 1 warned, 0 failed (--strict: warnings fail)"
        )
        assert document["warned"] == 1


async def test_cli_json_is_one_document_with_every_result(short_dir: Path) -> None:
    out = io.StringIO()
    async with serving_raw(short_dir / "raw.sock"):
        args = parse(["conformance", "--socket", str(short_dir / "raw.sock"), "--json"])
        code = await _cli_probe._conformance(args, out)
    document = json.loads(out.getvalue())
    assert code == 0
    assert document["ok"] is True
    assert document["failed"] == 0
    assert [r["name"] for r in document["results"]] == SOCKET_CHECKS


async def test_cli_register_dir_announces_kubelet_sock_and_groups_by_resource(
    short_dir: Path,
) -> None:
    out = io.StringIO()
    args = parse(
        ["conformance", "--register-dir", str(short_dir), "--wait", "5", "--restart-timeout", "5"]
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve_forever, [Widgets()], settings(short_dir))
        code = await _cli_probe._conformance(args, out)
        tg.cancel_scope.cancel()
    lines = out.getvalue().splitlines()
    assert code == 0, out.getvalue()
    assert lines[0] == f"serving {short_dir / 'kubelet.sock'}; waiting for a plugin to register"
    assert lines[1] == f"== {RESOURCE}"
    assert lines[-2].startswith("PASS  reregisters-after-restart  after the kubelet restart")
    assert lines[-1] == f"{len(REGISTER_CHECKS)} passed, 0 failed"


async def test_conformance_command_exits_zero_for_a_conformant_plugin(short_dir: Path) -> None:
    script = (
        "import argparse, sys; from devplugin_sdk.kubelet import _cli_probe; "
        "p = argparse.ArgumentParser(); _cli_probe.register(p.add_subparsers()); "
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    async with serving_raw(short_dir / "raw.sock"):
        ok = await anyio.run_process(
            [sys.executable, "-c", script, "conformance", "--socket", str(short_dir / "raw.sock")],
            check=False,
        )
    missing = await anyio.run_process(
        [sys.executable, "-c", script, "conformance", "--socket", str(short_dir / "gone.sock")],
        check=False,
    )
    assert ok.returncode == 0, ok.stdout.decode()
    assert ok.stdout.decode().splitlines()[-1].endswith("passed, 0 failed")
    assert missing.returncode == 1
    assert "FAIL  dial  no socket at" in missing.stdout.decode()


async def test_the_shipped_commands_do_not_import_the_testing_package() -> None:
    """probe and conformance run the kubelet simulator from its engine home, not from testing."""
    script = (
        "import sys; import devplugin_sdk.kubelet._cli_probe, devplugin_sdk.kubelet.conformance, "
        "devplugin_sdk.kubelet.probe; "
        "print(sorted(m for m in sys.modules if m.startswith('devplugin_sdk.testing')))"
    )
    result = await anyio.run_process([sys.executable, "-c", script])
    assert result.stdout.decode().strip() == "[]"
