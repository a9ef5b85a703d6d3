"""`devplugin conformance --dra`: the DRA suite against the SDK's driver and broken ones."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk._wire import server as _server
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim
from devplugin_sdk._wire.dra_service import handlers
from devplugin_sdk.kubelet import conformance
from devplugin_sdk.testing import DraNode, StaticPlugin


async def test_the_sdks_driver_passes(short_dir: Path) -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        socket = node.kubelet.registry_directory / f"{DRIVER}-reg.sock"
        report = await conformance.check_dra_socket(socket)
        assert [r.status for r in report.results] == ["pass"] * len(conformance.DRA_CHECKS)
        assert report.succeeded(strict=True)
        # The CLI, as a user runs it (a process of its own), on the DRA socket itself.
        dra_socket = node.options.resolved_plugin_dir / "dra.sock"
        command = [sys.executable, "-m", "devplugin_sdk", "conformance", "--dra"]
        result = await anyio.run_process([*command, "--socket", str(dra_socket)], check=False)
        assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


async def _serve_broken(
    path: Path, prepare, unprepare, *, info_socket: Path | None, versions: Sequence[str]
):  # type: ignore[no-untyped-def]
    servers = []
    dra_server, _ = await _server.start_server(
        path, handlers(prepare, unprepare, ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
    )
    servers.append(dra_server)
    if info_socket is not None:
        reg = watcher_registration.handler(
            DRIVER,
            lambda ok, error: None,
            plugin_type="DRAPlugin",
            endpoint=str(path),
            versions=versions,
        )
        reg_server, _ = await _server.start_server(info_socket, [reg])
        servers.append(reg_server)
    return servers


async def test_a_driver_that_fails_claims_wholesale_and_keeps_unprepare_errors(
    short_dir: Path,
) -> None:
    async def prepare(claims: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        # Like kubeletplugin: a claim it cannot read fails the whole call.
        if claims:
            raise RuntimeError("get resource claims: not found")
        return {}

    async def unprepare(claims: Sequence[ClaimRef]) -> dict[str, str]:
        return {c.uid: "not prepared" for c in claims}

    servers = await _serve_broken(
        short_dir / "dra.sock",
        prepare,
        unprepare,
        info_socket=short_dir / "reg.sock",
        versions=["v1beta1.DRAPlugin"],
    )
    try:
        report = await conformance.check_dra_socket(
            short_dir / "reg.sock", conformance.Limits(timeout=5)
        )
    finally:
        for server in servers:
            await server.stop(0)
    got = {r.name: r.status for r in report.results}
    assert got == {
        "dra-registration": "warn",
        "dra-services-answer": "pass",
        "dra-health-stream": "warn",  # none listed
        "dra-prepare-claims-alone": "warn",
        "dra-unprepare-idempotent": "fail",
        "dra-concurrent-calls": "pass",
    }
    assert not report.ok


async def test_a_driver_that_leaves_out_claims_or_speaks_no_known_service(short_dir: Path) -> None:
    async def prepare(claims: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        return {}

    async def unprepare(claims: Sequence[ClaimRef]) -> dict[str, str]:
        return {}

    servers = await _serve_broken(
        short_dir / "dra.sock", prepare, unprepare, info_socket=None, versions=()
    )
    try:
        report = await conformance.check_dra_socket(
            short_dir / "dra.sock", conformance.Limits(timeout=5)
        )
    finally:
        for server in servers:
            await server.stop(0)
    got = {r.name: r.status for r in report.results}
    assert got["dra-registration"] == "skip"  # a DRA socket alone: tested as such
    assert got["dra-health-stream"] == "skip"  # no GetInfo list to read
    assert got["dra-prepare-claims-alone"] == "fail"
    assert got["dra-unprepare-idempotent"] == "fail"
    detail = {r.name: r.detail for r in report.results}
    assert "left out 1 claims" in detail["dra-prepare-claims-alone"]


@pytest.mark.parametrize("versions", [["v2.DRAPlugin"], []])
async def test_unknown_services_fail_registration(short_dir: Path, versions: list[str]) -> None:
    async def prepare(claims: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        return {c.uid: PreparedClaim(error="nope") for c in claims}

    async def unprepare(claims: Sequence[ClaimRef]) -> dict[str, str]:
        return {c.uid: "" for c in claims}

    servers = await _serve_broken(
        short_dir / "dra.sock",
        prepare,
        unprepare,
        info_socket=short_dir / "reg.sock",
        versions=versions,
    )
    try:
        report = await conformance.check_dra_socket(
            short_dir / "reg.sock", conformance.Limits(timeout=5)
        )
    finally:
        for server in servers:
            await server.stop(0)
    first = report.results[0]
    assert (first.name, first.status) == ("dra-registration", "fail")
    assert "name no service a kubelet speaks" in first.detail
    assert {r.status for r in report.results[1:]} == {"skip"}


async def test_a_listed_health_service_that_does_not_stream_fails(short_dir: Path) -> None:
    async def prepare(claims: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        return {c.uid: PreparedClaim(error="nope") for c in claims}

    async def unprepare(claims: Sequence[ClaimRef]) -> dict[str, str]:
        return {c.uid: "" for c in claims}

    servers = await _serve_broken(
        short_dir / "dra.sock",
        prepare,
        unprepare,
        info_socket=short_dir / "reg.sock",
        versions=["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"],
    )
    try:
        report = await conformance.check_dra_socket(
            short_dir / "reg.sock", conformance.Limits(timeout=5)
        )
    finally:
        for server in servers:
            await server.stop(0)
    (health,) = [r for r in report.results if r.name == "dra-health-stream"]
    assert health.status == "fail"
    assert health.detail.startswith("v1.DRAResourceHealth: UNIMPLEMENTED")
