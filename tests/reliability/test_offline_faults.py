"""Offline checks and configuration under hostile input (issue 36, rows 15, 16, 20, 21, 22, 27, 28).

Each test runs the real ``devplugin`` command in a subprocess: ``dra simulate`` with a CEL
selector that runs away or nests 100,000 deep, ``dra check``/``dra simulate`` on objects of the
wrong shape and on a cluster-sized ``kubectl get resourceslices -o yaml`` dump, ``devplugin run``
with an interval that would spin, environment variables that only look like numbers, and a node
label that names a path outside the configuration directory (read from the loopback API server).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
import yaml
from cli_process import ROOT, devplugin, environment
from kube_apiserver import FakeApiServer

from devplugin_sdk.testing import MemoryApi

pytestmark = pytest.mark.timeout(60)

SIMULATE = ROOT / "examples" / "dra-simulate"
GPU = "gpu.devplugin.example.com"
LABEL = "example.com/device-plugin.config"
NODE = "node-a"


def _run(*args: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m devplugin_sdk ARGS`` to its end, in ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "devplugin_sdk", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _claim(tmp_path: Path, *expressions: str, name: str = "claim.yaml") -> Path:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": GPU,
                            "selectors": [{"cel": {"expression": e}} for e in expressions],
                        },
                    }
                ]
            }
        },
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(claim, width=1 << 30))
    return path


def _simulate(*claims: Path, timeout: float = 40) -> Any:
    return devplugin(
        "dra", "simulate", "--slices", str(SIMULATE / "slices.yaml"),
        str(SIMULATE / "classes.yaml"), *map(str, claims), timeout=timeout,
    )  # fmt: skip


# ------------------------------------------------------------------ rows 16 and 20: CEL bounds

_TEN = "[0,1,2,3,4,5,6,7,8,9]"


def _exponential(levels: int, leaf: str = _TEN) -> str:
    """A list of 10**levels leaves, built by nested map(): exponential in time and memory."""
    expression = leaf
    for i in range(levels):
        expression = f"{_TEN}.map(x{i}, {expression})"
    return f"size({expression}) > 0"


#: A new kilobyte string per leaf: a million of them, a gigabyte.
_HUGE = _exponential(6, "'" + "x" * 1000 + "' + string(x0)")


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        (_exponential(7), "evaluation on 5 devices ran"),
        (_HUGE, "evaluation on 5 devices ran"),
        (" + ".join(["'" + "x" * 1000 + "'"] * 11) + " != ''", "longer than 10240"),
    ],
    ids=["exponential", "huge-value", "too-long"],
)
def test_a_runaway_cel_selector_is_refused_in_bounded_time(
    tmp_path: Path, expression: str, says: str
) -> None:
    claim = _claim(tmp_path, "device.driver != ''", expression)
    started = time.monotonic()
    done = _simulate(claim)
    took = time.monotonic() - started
    print(f"runaway selector refused in {took:.2f} s: {done.stderr.strip()[:200]}")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr[-2000:])
    (line,) = _lines(done.stderr)
    assert line.startswith(f"devplugin: error: {claim} document 1 (ResourceClaim c): ")
    assert "spec.devices.requests[0].exactly.selectors[1].cel.expression" in line
    assert says in line
    assert len(line) < 500, len(line)
    assert took < 30


def test_a_selector_past_the_memory_bound_stops_its_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devplugin_sdk.dra import _cel
    from devplugin_sdk.dra.simulate import SelectorError, simulate

    # A lower bound than the 512 MiB of a run, so that the kilobyte strings reach it first.
    monkeypatch.setattr(_cel, "MEMORY_BYTES", 160 << 20)
    slices = [d for d in yaml.safe_load_all((SIMULATE / "slices.yaml").read_text()) if d]
    classes = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all((SIMULATE / "classes.yaml").read_text())
        if d
    }
    claim = yaml.safe_load(_claim(tmp_path, "device.driver != ''", _HUGE).read_text())
    with pytest.raises(SelectorError) as caught:
        simulate(slices, claim["spec"], classes)
    ((document, key, message),) = caught.value.refused
    print(message)
    assert (document, key) == (
        "claim",
        "spec.devices.requests[0].exactly.selectors[1].cel.expression",
    )
    assert "ran out of its 160 MiB memory bound" in message


@pytest.mark.parametrize("opening", ["(", "["], ids=["parentheses", "brackets"])
def test_a_selector_nested_100k_deep_is_one_short_line(tmp_path: Path, opening: str) -> None:
    closing = {"(": ")", "[": "]"}[opening]
    claim = _claim(tmp_path, opening * 100_000 + "true" + closing * 100_000)
    done = _simulate(claim)
    print(f"{opening * 3}: {len(done.stderr)} bytes of stderr: {done.stderr[:240]!r}")
    assert done.returncode == 2, (done.returncode, done.stderr[:2000])
    (line,) = _lines(done.stderr)
    assert len(line) < 400, len(line)
    assert "spec.devices.requests[0].exactly.selectors[0].cel.expression" in line


def test_a_selector_nested_past_the_api_servers_limit_is_refused_up_front(tmp_path: Path) -> None:
    claim = _claim(tmp_path, "(" * 300 + "true" + ")" * 300)
    done = _simulate(claim)
    (line,) = _lines(done.stderr)
    assert "nested deeper than 250" in line, line
    assert len(line) < 400, len(line)


def test_ordinary_selectors_still_pick_devices(tmp_path: Path) -> None:
    claim = _claim(tmp_path, f'device.capacity["{GPU}"].memory.compareTo(quantity("40Gi")) >= 0')
    done = _simulate(claim)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _lines(done.stdout) == [f"request gpu: gpu-0 (driver {GPU}, pool node-1)"]


# ------------------------------------------------------------------ row 27: wrong shapes


def _slices_doc() -> dict[str, Any]:
    (first, *_) = [d for d in yaml.safe_load_all((SIMULATE / "slices.yaml").read_text()) if d]
    return dict(first)


def _claim_doc() -> dict[str, Any]:
    return dict(yaml.safe_load((SIMULATE / "big-gpu.yaml").read_text()))


def _set(doc: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    target: Any = doc
    for part in parts[:-1]:
        target = target[int(part[1:-1])] if part.startswith("[") else target[part]
    last = parts[-1]
    if last.startswith("["):
        target[int(last[1:-1])] = value
    else:
        target[last] = value
    return doc


#: (which document, dotted key, the wrong value)
SHAPES: list[tuple[str, str, Any]] = [
    ("slice", "spec", 5),
    ("slice", "metadata", "x"),
    ("slice", "spec.pool", [1]),
    ("slice", "spec.pool.generation", "new"),
    ("slice", "spec.pool.resourceSliceCount", "many"),
    ("slice", "spec.devices", {"a": 1}),
    ("slice", "spec.devices[0]", 7),
    ("slice", "spec.devices[0].name", 5),
    ("slice", "spec.devices[0].attributes", 5),
    ("slice", "spec.devices[0].attributes.type", 5),
    ("slice", "spec.devices[0].attributes.type", {"string": [1]}),
    ("slice", "spec.devices[0].attributes.type", {"string": "gpu", "int": 1}),
    ("slice", "spec.devices[0].attributes.type", {}),
    ("slice", "spec.devices[0].capacity", ["x"]),
    ("slice", "spec.devices[0].capacity.memory", 5),
    ("slice", "spec.devices[0].capacity.memory.value", {"a": 1}),
    ("slice", "spec.devices[0].capacity.memory.value", "lots"),
    ("slice", "spec.devices[0].taints", {"key": "k"}),
    ("slice", "spec.devices[0].consumesCounters", 3),
    ("slice", "spec.devices[0].allowMultipleAllocations", "yes"),
    ("claim", "spec", []),
    ("claim", "spec.devices", 1),
    ("claim", "spec.devices.requests", 5),
    ("claim", "spec.devices.requests[0]", "gpu"),
    ("claim", "spec.devices.requests[0].exactly", 5),
    ("claim", "spec.devices.requests[0].exactly.count", "many"),
    ("claim", "spec.devices.requests[0].exactly.count", True),
    ("claim", "spec.devices.requests[0].exactly.deviceClassName", 5),
    ("claim", "spec.devices.requests[0].exactly.selectors", {"cel": 1}),
    ("claim", "spec.devices.requests[0].exactly.capacity", 5),
    ("claim", "spec.devices.requests[0].exactly.capacity.requests.memory", {"a": 1}),
    ("claim", "spec.devices.requests[0].firstAvailable", {"name": "x"}),
    ("claim", "spec.devices.constraints", 5),
]


@pytest.mark.parametrize(
    ("which", "key", "value"), SHAPES, ids=[f"{w}:{k}={v!r}" for w, k, v in SHAPES]
)
def test_each_wrong_shape_is_one_error_naming_the_document_and_key(
    tmp_path: Path, which: str, key: str, value: Any
) -> None:
    slices, claim = _slices_doc(), _claim_doc()
    if which == "slice":
        slices = _set(slices, key, value)
    else:
        claim = _set(claim, key, value)
    slices_file = tmp_path / "slices.yaml"
    slices_file.write_text(yaml.safe_dump(slices))
    claim_file = tmp_path / "claim.yaml"
    claim_file.write_text(yaml.safe_dump(claim))
    commands = [("simulate", slices_file, claim_file)]
    if which == "slice":
        commands.append(("check", slices_file, None))
    for command, slices_path, claim_path in commands:
        args = ["dra", command, "--slices", str(slices_path)]
        if claim_path is not None:
            args += [str(SIMULATE / "classes.yaml"), str(claim_path)]
        done = devplugin(*args)
        lines = _lines(done.stderr)
        assert done.returncode == 2, (command, done.returncode, done.stdout, done.stderr)
        assert len(lines) == 1, (command, done.stderr)
        document = slices_path if which == "slice" else claim_path
        assert lines[0].startswith(f"devplugin: error: {document} document 1"), lines[0]
        assert f": {key}:" in lines[0] or f": {key}." in lines[0], lines[0]
        assert "Traceback" not in done.stderr


def test_a_list_item_of_the_wrong_shape_names_its_index(tmp_path: Path) -> None:
    dump = {"apiVersion": "v1", "kind": "List", "items": [_slices_doc(), 5]}
    path = tmp_path / "dump.yaml"
    path.write_text(yaml.safe_dump(dump))
    done = devplugin("dra", "check", "--slices", str(path))
    (line,) = _lines(done.stderr)
    assert line.startswith(f"devplugin: error: {path} document 1 items[1]: "), line


# ------------------------------------------------------------------ row 28: cluster dumps

_ATTRIBUTES = {
    "type": {"string": "gpu"},
    "productName": {"string": "NVIDIA H100 80GB HBM3"},
    "brand": {"string": "Nvidia"},
    "architecture": {"string": "Hopper"},
    "cudaComputeCapability": {"version": "9.0.0"},
    "driverVersion": {"version": "550.54.15"},
    "cudaDriverVersion": {"version": "12.4.0"},
    "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
}


def _node_slice(node: int) -> dict[str, Any]:
    """One node's GPU slice as ``kubectl get resourceslices -o yaml`` prints it."""
    name = f"gpu-node-{node:04d}"
    devices = [
        {
            "name": f"gpu-{i}",
            "attributes": {
                **copy.deepcopy(_ATTRIBUTES),
                "index": {"int": i},
                "minor": {"int": i},
                "uuid": {"string": f"GPU-{node:08x}-{i:04x}-4c1a-9f0e-5b7d2c8e1a{i:02d}"},
                "pciBusID": {"string": f"0000:{0x18 + i * 16:02x}:00.0"},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
        for i in range(8)
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "creationTimestamp": "2026-11-20T10:00:00Z",
            "generateName": f"{name}-gpu.nvidia.com-",
            "generation": 1,
            "name": f"{name}-gpu.nvidia.com-x7k2p",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "controller": True,
                    "kind": "Node",
                    "name": name,
                    "uid": f"7c3e9a1b-{node:04d}-4d2f-8e6a-1b2c3d4e5f60",
                }
            ],
            "resourceVersion": str(1000000 + node),
            "uid": f"0a1b2c3d-{node:04d}-4e5f-8a9b-0c1d2e3f4a5b",
        },
        "spec": {
            "devices": devices,
            "driver": "gpu.nvidia.com",
            "nodeName": name,
            "pool": {"generation": 1, "name": name, "resourceSliceCount": 1},
        },
    }


def test_dra_check_reads_a_dump_of_a_large_cluster(tmp_path: Path) -> None:
    dump = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [_node_slice(n) for n in range(330)],
        "metadata": {"resourceVersion": ""},
    }
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump(dump, sort_keys=True))
    size = path.stat().st_size
    started = time.monotonic()
    done = devplugin("dra", "check", "--slices", str(path), "--quiet", timeout=50)
    print(f"{size / 1e6:.2f} MB dump of 330 nodes: {time.monotonic() - started:.2f} s")
    assert size > 1 << 20  # over the configuration files' cap
    assert done.returncode == 0, done.stderr[-500:]
    assert "330 slices, 2640 devices: 0 errors" in done.stdout


def test_a_cluster_dump_with_an_alias_bomb_is_still_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
        for i in range(1, 10)
    ]
    lines += ["kind: ResourceSlice"]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    done = devplugin("dra", "check", "--slices", str(path))
    assert time.monotonic() - started < 20
    (line,) = _lines(done.stderr)
    assert "aliases expand to more than" in line, line


# ------------------------------------------------------------------ rows 15 and 21: intervals


def _generic(tmp_path: Path, **extra: Any) -> Path:
    devices = tmp_path / "dev"
    devices.mkdir(exist_ok=True)
    (devices / "widget0").touch()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backend": "generic",
                "resources": [{"resourceName": "example.com/widget", "paths": [f"{devices}/w*"]}],
                **extra,
            }
        )
    )
    return config


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"rescanInterval": 1e-9}, "rescanInterval: must be 0 (off) or at least 1 s"),
        ({"rescanInterval": 0.5}, "rescanInterval: must be 0 (off) or at least 1 s"),
        ({"metrics": {"stuckAfter": 1e-300}}, "metrics.stuckAfter: must be > 0: at least 1 s"),
        (
            {"api": "both", "dra": {"driver": "widget.example.com", "cleanupInterval": 1e-9}},
            "dra.cleanupInterval: must be 0 (off) or at least 10 s",
        ),
        ({"healthInterval": 1e-9}, "healthInterval: must be at least 0.01 s"),
    ],
    ids=["rescan-1e-9", "rescan-half-second", "stuck-after", "cleanup", "backend-health"],
)
def test_an_interval_under_its_bound_is_refused_naming_the_key(
    tmp_path: Path, extra: dict[str, Any], says: str
) -> None:
    config = _generic(tmp_path, **extra)
    done = devplugin(
        "run", "--config", str(config), "--device-plugin-dir", str(tmp_path), timeout=15
    )
    assert done.returncode == 2, done.stderr
    (line,) = _lines(done.stderr)
    assert line.startswith(f"devplugin: error: {says}"), line


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DEVPLUGIN_METRICS_PORT", "\uff18\uff10\uff18\uff10"),  # fullwidth 8080
        ("DEVPLUGIN_METRICS_PORT", "1_0"),
        ("DEVPLUGIN_METRICS_PORT", " 9090"),
        ("DEVPLUGIN_STUCK_AFTER", "1e-300"),
        ("DEVPLUGIN_STUCK_AFTER", "\uff13\uff10"),  # fullwidth 30
        ("DEVPLUGIN_STUCK_AFTER", "3_0"),
    ],
)
def test_an_environment_variable_that_only_looks_like_a_number_is_refused(
    tmp_path: Path, variable: str, value: str
) -> None:
    config = _generic(tmp_path)
    env = {**environment(), variable: value}
    done = _run("run", "--config", str(config), "--device-plugin-dir", str(tmp_path), env=env)
    assert done.returncode == 2, done.stderr
    (line,) = _lines(done.stderr)
    assert line.startswith(f"devplugin: error: {variable}: "), line


# ------------------------------------------------------------------ row 22: node labels


async def test_a_label_value_that_is_a_path_is_refused(tmp_path: Path) -> None:
    devices = tmp_path / "dev"
    devices.mkdir()
    configs = tmp_path / "configs"
    configs.mkdir()
    default = configs / "default.yaml"
    default.write_text(
        f"resources:\n  - resourceName: example.com/w\n    paths: ['{devices}/w*']\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "evil.yaml").write_text("evil: read from outside the directory\n")
    server = FakeApiServer(MemoryApi(nodes=[NODE]))
    server.node_labels[NODE] = {LABEL: "../elsewhere/evil"}
    async with server.serving():
        env = {
            **environment(),
            "NODE_NAME": NODE,
            "KUBECONFIG": str(server.kubeconfig(tmp_path / "kubeconfig")),
            "DEVPLUGIN_NODE_CONFIG_LABEL": LABEL,
        }
        args = ("run", "generic", "--config", str(default), "--device-plugin-dir", str(tmp_path))
        done = await anyio.to_thread.run_sync(lambda: _run(*args, env=env))
    assert done.returncode == 2, done.stderr
    (line,) = _lines(done.stderr)
    assert line.startswith(
        f"devplugin: error: --node-config-label: node {NODE} has {LABEL}='../elsewhere/evil', "
        "which is not a label value"
    ), line
    assert "evil: read" not in line


@pytest.mark.parametrize("name", ["rescan_interval", "health_interval", "restart_poll_interval"])
def test_the_python_api_refuses_a_loop_period_of_nanoseconds(name: str) -> None:
    from devplugin_sdk import Settings

    with pytest.raises(ValueError, match=rf"Settings\.{name} must be .*at least 0\.01 s"):
        Settings(**{name: 1e-9})
