"""The device-plugin suite (``CHECKS``) and its two runs: ``check_socket`` on a plugin's socket,
``check_register_dir`` as the kubelet (``FakeKubelet``) on a directory, which tests each plugin
that registers and then restarts the kubelet (``RESTART_CHECK``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from devplugin_sdk._limits import Limits
from devplugin_sdk._wire.server import is_live_socket
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.conformance._allocation_checks import ALLOCATION_CHECKS
from devplugin_sdk.kubelet.conformance._listing_checks import LISTING_CHECKS, STREAM_CHECKS
from devplugin_sdk.kubelet.conformance._report import (
    Check,
    CheckResult,
    ConformanceError,
    ConformanceReport,
    OnResult,
    emitter,
    ms,
    run_check,
)
from devplugin_sdk.kubelet.conformance._subject import Subject
from devplugin_sdk.kubelet.fake import FakeKubelet

__all__ = ["CHECKS", "RESTART_CHECK", "RESTART_KUBELET", "check_register_dir", "check_socket"]

#: The device-plugin checks, in the order they run.
CHECKS: tuple[Check[Subject], ...] = (*LISTING_CHECKS, *ALLOCATION_CHECKS, *STREAM_CHECKS)

RESTART_CHECK = "reregisters-after-restart"
#: The kubelet behaviour behind the restart check of ``--register-dir`` (fail only).
RESTART_KUBELET = (
    "dm/manager.go:Start runs dm/manager.go:CleanupPluginDirectory, which deletes every plugin "
    "socket, and creates kubelet.sock again; only a new Register brings a resource back"
)


async def _run_suite(
    subject: Subject, emit: OnResult, *, resource: str | None = None, register: bool = False
) -> None:
    for check in CHECKS:
        if check.register_only and not register:
            continue
        emit(await run_check(check, subject, resource))


async def check_socket(
    path: str | os.PathLike[str],
    limits: Limits | None = None,
    on_result: OnResult | None = None,
) -> ConformanceReport:
    """Run the suite against a plugin serving on ``path`` (registered elsewhere or not).

    Args:
        path: The plugin's unix socket.
        limits: Thresholds and timeouts.
        on_result: Called with each result as soon as it is known (for streaming output).

    Returns:
        The report; ``report.ok`` is the verdict.
    """
    limits = limits or Limits()
    report = ConformanceReport("socket", str(path))
    async with Subject(Path(path), limits) as subject:
        await _run_suite(subject, emitter(report, on_result))
    return report


async def check_register_dir(
    directory: str | os.PathLike[str],
    limits: Limits | None = None,
    on_result: OnResult | None = None,
    on_waiting: Callable[[Path], None] | None = None,
) -> ConformanceReport:
    """Act as the kubelet on ``directory``/kubelet.sock and test every plugin that registers.

    Waits for ``limits.expect`` resources to register (then ``limits.settle`` seconds for
    more), runs the suite against each plugin's socket, then restarts the kubelet (directory
    wiped, kubelet.sock recreated) and checks that each plugin registers again.

    Args:
        directory: The device-plugin directory to serve (created if missing; its files are
            deleted, as at kubelet start).
        limits: Thresholds and timeouts.
        on_result: Called with each result as soon as it is known.
        on_waiting: Called once kubelet.sock is served, before waiting for registrations.

    Raises:
        ConformanceError: a live server (a real kubelet?) already answers on kubelet.sock.
    """
    limits = limits or Limits()
    directory = Path(directory)
    socket_path = directory / constants.KUBELET_SOCKET_NAME
    if await anyio.to_thread.run_sync(is_live_socket, socket_path):
        raise ConformanceError(
            f"{socket_path} is served by a live process (a kubelet?); conformance "
            "--register-dir would wipe its directory. Use --socket for a plugin registered there."
        )
    report = ConformanceReport("register-dir", str(directory))
    emit = emitter(report, on_result)

    async with FakeKubelet(directory=directory) as kubelet:
        if on_waiting is not None:
            on_waiting(kubelet.socket_path)
        missing = await _wait_for_resources(kubelet, limits)
        if missing is not None:
            emit(missing)
            return report
        if limits.settle > 0:
            await anyio.sleep(limits.settle)  # other resources of one process register together
        for resource in _resources(kubelet):
            await _check_registered(kubelet, resource, limits, emit)
        emit(await _restart_check(kubelet, _resources(kubelet), limits))
    return report


def _resources(kubelet: FakeKubelet) -> list[str]:
    """The resources that registered (successfully or not), in order of first registration."""
    return list(dict.fromkeys(r.resource_name for r in kubelet.registrations))


async def _wait_for_resources(kubelet: FakeKubelet, limits: Limits) -> CheckResult | None:
    """Wait for ``limits.expect`` resources to register; the failure when they do not."""
    try:
        await kubelet.wait_for(
            lambda: len(_resources(kubelet)) >= limits.expect,
            timeout=limits.register_wait,
            what=f"{limits.expect} resource(s) to register",
        )
    except TimeoutError:
        resources = _resources(kubelet)
        return CheckResult(
            "registration-valid",
            "fail",
            f"nothing registered on {kubelet.socket_path} within {limits.register_wait:g} s"
            if not resources
            else f"only {len(resources)} resource(s) registered within "
            f"{limits.register_wait:g} s: {', '.join(resources)}",
        )
    return None


async def _check_registered(
    kubelet: FakeKubelet, resource: str, limits: Limits, emit: OnResult
) -> None:
    """Run the suite on the socket ``resource`` registered, with its registration."""
    records = [r for r in kubelet.registrations if r.resource_name == resource]
    # A transient failure (dial before serving) followed by success is judged by the
    # success; a plugin that never succeeded by its last attempt.
    record = next((r for r in reversed(records) if r.error is None), records[-1])
    path = _endpoint_path(kubelet.directory, record.endpoint)
    async with Subject(path, limits) as subject:
        subject.registration = record
        await _run_suite(subject, emit, resource=resource, register=True)


def _endpoint_path(directory: Path, endpoint: str) -> Path:
    # The kubelet joins the endpoint onto its directory (filepath.Join) and checks nothing else.
    return Path(os.path.normpath(os.path.join(directory, endpoint.lstrip("/"))))


async def _restart_check(
    kubelet: FakeKubelet, resources: Sequence[str], limits: Limits
) -> CheckResult:
    """Restart the kubelet and time each resource's registration and first list."""
    before = {r: len(kubelet.successful_registrations(r)) for r in resources}
    await kubelet.restart()
    restarted = time.monotonic()
    messages = {r: kubelet.messages(r) for r in resources}
    registered: dict[str, float] = {}
    listed: dict[str, float] = {}

    def progress() -> bool:
        now = time.monotonic()
        for r in resources:
            done = kubelet.successful_registrations(r)
            if r not in registered and len(done) > before[r]:
                registered[r] = done[before[r]].at - restarted
            if r in registered and r not in listed and kubelet.messages(r) > messages[r]:
                listed[r] = now - restarted
        return len(listed) == len(resources)

    try:
        await kubelet.wait_for(progress, timeout=limits.restart_timeout, what="re-registration")
    except TimeoutError:
        late = [r for r in resources if r not in listed]
        detail = "; ".join(
            f"{r} did not register again" if r not in registered else f"{r} sent no list"
            for r in late
        )
        return CheckResult(
            RESTART_CHECK,
            "fail",
            f"{detail} within {limits.restart_timeout:g} s of a kubelet restart (directory "
            "wiped, kubelet.sock recreated); plugins must watch for it and register again",
        )
    parts = [
        f"{r}: registered {ms(max(registered[r], 0.0))}, first list {ms(listed[r])}"
        for r in resources
    ]
    return CheckResult(RESTART_CHECK, "pass", "after the kubelet restart " + "; ".join(parts))
