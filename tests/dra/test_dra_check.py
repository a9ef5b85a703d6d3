"""``devplugin dra check`` (issue 28 item 6): the slices a configuration would publish, printed
and validated offline against the v1 rules of Kubernetes 1.34-1.37. Ten seeded slice mistakes,
each caught (the list below), through the real command in a subprocess; a clean pool passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_process import devplugin

from devplugin_sdk.dra.check import VERSIONS, check_slices

DRIVER = "gpu.devplugin.example.com"


def a_slice(name: str, devices: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-1",
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
            **spec,
        },
    }


def gpu(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"index": {"int": 0}},
        "capacity": {"memory": {"value": "40Gi"}},
        **fields,
    }


TAINT = {"key": f"{DRIVER}/health", "value": "xid-79", "effect": "NoSchedule"}
RANGE = {"default": "1Gi", "validRange": {"min": "1Gi", "max": "42Gi", "step": "2Gi"}}

#: Each mistake: the slice that makes it, and what the check must say about it.
MISTAKES: list[tuple[str, dict[str, Any], str]] = [
    (
        "129 devices in one slice",
        a_slice("too-many", [gpu(f"gpu-{i}") for i in range(129)]),
        "129 devices: at most 128 per slice",
    ),
    (
        "65 devices with taints in one slice",
        a_slice("too-many-tainted", [gpu(f"gpu-{i}", taints=[TAINT]) for i in range(65)]),
        "65 devices: at most 64 per slice (a device has taints or consumes counters)",
    ),
    (
        "33 attributes and capacities on one device",
        a_slice(
            "too-many-attributes",
            [gpu("gpu-0", attributes={f"a{i}": {"int": i} for i in range(32)})],
        ),
        "32 attributes and 1 capacities: at most 32 together",
    ),
    (
        "17 taints on one device",
        a_slice(
            "too-many-taints",
            [gpu("gpu-0", taints=[{**TAINT, "value": f"v{i}"} for i in range(17)])],
        ),
        "17 taints: at most 16",
    ),
    (
        "a device name that is not a DNS label",
        a_slice("bad-name", [gpu("GPU_0")]),
        "devices[0].name: 'GPU_0'",
    ),
    (
        "an attribute name longer than 32 characters",
        a_slice("bad-attribute", [gpu("gpu-0", attributes={"x" * 33: {"int": 1}})]),
        f"devices[0].attributes[{'x' * 33}]",
    ),
    (
        "devices and sharedCounters in one slice (1.35 split)",
        a_slice(
            "mixed",
            [gpu("gpu-0")],
            sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "40Gi"}}}],
        ),
        "devices and sharedCounters in one slice: from 1.35 counters go in a slice of their own",
    ),
    (
        "consumesCounters naming a counter set that does not exist",
        a_slice(
            "dangling",
            [
                gpu(
                    "mig-0",
                    consumesCounters=[
                        {"counterSet": "nowhere", "counters": {"memory": {"value": "10Gi"}}}
                    ],
                )
            ],
        ),
        "devices[0].consumesCounters[0].counterSet: 'nowhere' is not a counter set",
    ),
    (
        "a requestPolicy whose max is not a multiple of step from min",
        a_slice(
            "bad-step",
            [gpu("gpu-0", capacity={"memory": {"value": "80Gi", "requestPolicy": RANGE}})],
        ),
        "requestPolicy.validRange.max is not a multiple of step from min",
    ),
    (
        "taint effect None on 1.34",
        a_slice("none-effect", [gpu("gpu-0", taints=[{**TAINT, "effect": "None"}])]),
        "'None': must be one of NoSchedule, NoExecute (Kubernetes 1.34)",
    ),
]


def test_the_mistakes_listed_are_ten_distinct_ones() -> None:
    assert len(MISTAKES) == 10
    assert len({m[0] for m in MISTAKES}) == 10


def test_dra_check_catches_each_seeded_mistake(tmp_path: Path) -> None:
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump_all([s for _, s, _ in MISTAKES]))
    done = devplugin("dra", "check", "--slices", str(path), "--quiet")
    assert done.returncode == 1, done.stderr
    missed = [what for what, _, said in MISTAKES if said not in done.stdout]
    assert missed == [], done.stdout
    # Each one alone is caught too (no mistake hides behind another).
    for what, bad, said in MISTAKES:
        problems = [str(p) for p in check_slices([bad]) if p.severity == "error"]
        assert any(said in p for p in problems), (what, problems)


def test_a_clean_pool_passes_and_alpha_fields_are_warnings(tmp_path: Path) -> None:
    counters = a_slice(
        "node-1",
        [],
        sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "40Gi"}}}],
    )
    counters["spec"]["pool"]["resourceSliceCount"] = 2
    devices = a_slice(
        "node-1",
        [
            gpu(
                "mig-0",
                consumesCounters=[
                    {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "10Gi"}}}
                ],
            )
        ],
    )
    devices["metadata"]["name"] = "node-1-b"
    devices["spec"]["pool"]["resourceSliceCount"] = 2
    problems = check_slices([counters, devices], versions=VERSIONS[1:])
    assert [p for p in problems if p.severity == "error"] == []
    assert {p.versions for p in problems} == {("1.35",)}  # alpha there, dropped by default
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump_all([a_slice("ok", [gpu("gpu-0"), gpu("gpu-1")])]))
    done = devplugin("dra", "check", "--slices", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 slices, 2 devices: 0 errors, 0 warnings" in done.stdout
    assert "name: gpu-1" in done.stdout  # the slices are printed


def test_dra_check_prints_what_a_configuration_would_publish(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(3):
        (dev / f"ttyUSB{i}").touch()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backend": "generic",
                "api": "dra",
                "dra": {"driver": "serial.example.com", "nodeName": "node-1"},
                "devRoot": str(dev),
                "resources": [{"resourceName": "example.com/serial", "paths": ["/dev/ttyUSB*"]}],
            }
        )
    )
    done = devplugin("dra", "check", "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    (printed, *_) = [d for d in yaml.safe_load_all(done.stdout.split("---\n1 slices")[0]) if d]
    assert printed["spec"]["driver"] == "serial.example.com"
    assert [d["name"] for d in printed["spec"]["devices"]] == ["ttyusb0", "ttyusb1", "ttyusb2"]
    assert "1 slices, 3 devices: 0 errors" in done.stdout


@pytest.mark.parametrize("option", ["--slices", "--config"])
def test_a_missing_file_is_one_line_naming_it(tmp_path: Path, option: str) -> None:
    done = devplugin("dra", "check", option, str(tmp_path / "nope.yaml"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "nope.yaml" in done.stderr
