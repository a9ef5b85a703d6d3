"""``devplugin dra simulate`` (issue 28 item 6) agrees with the picks computed by hand for the
documented examples (examples/dra-simulate, docs/dra.md "Checking slices and claims offline"):
two GPUs in one NVLink domain, a GPU and a NIC on one NUMA node, a GPU of at least 40 GiB; and
says why when nothing fits. The real command, in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_process import ROOT, devplugin

pytest.importorskip("cel", reason="dra simulate needs the cel extra (Python 3.11+)")

EXAMPLES = ROOT / "examples" / "dra-simulate"
GPU = "gpu.devplugin.example.com"
NIC = "rdma.devplugin.example.com"


def simulate(*claim: Path) -> tuple[int, list[str]]:
    done = devplugin(
        "dra",
        "simulate",
        "--slices",
        str(EXAMPLES / "slices.yaml"),
        str(EXAMPLES / "classes.yaml"),
        *map(str, claim),
    )
    assert not done.stderr, done.stderr
    return done.returncode, done.stdout.splitlines()


@pytest.mark.parametrize(
    ("claim", "picks"),
    [
        # gpu-0 is compute capability 8.0 (not > 8.9); gpu-1 is first, gpu-2 is in the other
        # NVLink domain, gpu-3 is in gpu-1's.
        ("two-linked-gpus.yaml", [("gpus", "gpu-1", GPU), ("gpus", "gpu-3", GPU)]),
        # gpu-0 (NUMA 0) first, but the only NIC is on NUMA 1: back to gpu-1.
        ("gpu-and-nic.yaml", [("gpu", "gpu-1", GPU), ("nic", "mlx5-1", NIC)]),
        # 40 GiB asked, gpu-0 has exactly that.
        ("big-gpu.yaml", [("gpu", "gpu-0", GPU)]),
    ],
)
def test_simulate_agrees_with_the_hand_computed_picks(
    claim: str, picks: list[tuple[str, str, str]]
) -> None:
    code, lines = simulate(EXAMPLES / claim)
    assert code == 0
    assert lines == [
        f"request {request}: {device} (driver {driver}, pool node-1)"
        for request, device, driver in picks
    ]


def test_simulate_says_why_nothing_fits(tmp_path: Path) -> None:
    three = tmp_path / "three.yaml"
    three.write_text(
        (EXAMPLES / "two-linked-gpus.yaml").read_text().replace("count: 2", "count: 3")
    )
    code, lines = simulate(three)
    assert code == 1
    assert lines[0] == "no allocation:"
    assert "request gpus needs 3; 3 of 5 devices match" in lines[1]
    assert "request gpus selector #0 is false" in lines[1]
    assert "matchAttribute gpu.devplugin.example.com/nvlinkDomain differs" in lines[1]


def test_a_selector_failing_at_run_time_fails_the_claim_as_the_scheduler_does(
    tmp_path: Path,
) -> None:
    claim = tmp_path / "missing.yaml"
    claim.write_text(
        (EXAMPLES / "big-gpu.yaml")
        .read_text()
        .replace(
            "        capacity:",
            "        selectors:\n"
            "        - cel:\n"
            '            expression: device.attributes["gpu.devplugin.example.com"].nosuch == 1\n'
            "        capacity:",
        )
    )
    code, lines = simulate(claim)
    assert code == 1
    assert (
        "the scheduler would fail the claim: request gpu selector #0: CEL runtime error"
        in (lines[1])
    )


def test_an_unknown_domain_is_an_empty_map_and_versions_compare_as_semver(
    tmp_path: Path,
) -> None:
    # k8s cel/compile.go: an unknown domain reads as an empty map, so `in` is false, no error.
    claim = tmp_path / "domain.yaml"
    claim.write_text(
        (EXAMPLES / "big-gpu.yaml")
        .read_text()
        .replace(
            "        capacity:",
            "        selectors:\n"
            "        - cel:\n"
            "            expression: >-\n"
            '              !("x" in device.attributes["other.example.com"]) &&\n'
            '              device.attributes["gpu.devplugin.example.com"].cudaComputeCapability'
            '.compareTo(semver("10.0.0")) < 0 &&\n'
            '              device.attributes["gpu.devplugin.example.com"].cudaComputeCapability'
            '.isGreaterThan(semver("8.10.0"))\n'
            "        capacity:",
        )
    )
    code, lines = simulate(claim)
    assert (code, lines) == (0, [f"request gpu: gpu-1 (driver {GPU}, pool node-1)"])
