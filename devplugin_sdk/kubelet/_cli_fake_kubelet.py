"""The ``devplugin fake-kubelet`` command: a kubelet on a laptop, to try a plugin against.

It runs the SDK's kubelet simulator (``kubelet.fake.FakeKubelet``, the one behind
``devplugin_sdk.testing``) on a directory until Ctrl-C or SIGTERM and prints, as they happen,
what the kubelet sees: registrations, capacity changes, health flips and streams ending. Like a
real kubelet it starts by deleting every file in its directory but its checkpoint and then
creates ``kubelet.sock``, so plugins still running from before register again; SIGHUP restarts
it in place. It refuses a directory holding files that are not sockets (it would delete them)
and a directory where another kubelet answers.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import anyio

from devplugin_sdk._names import socket_path_problem
from devplugin_sdk.api import constants
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.kubelet import _cli_probe

if TYPE_CHECKING:
    from devplugin_sdk.kubelet import fake as _fake_kubelet

__all__ = ["register", "run_fake_kubelet"]

_MAX_FLIPS = 10  # health flips printed one by one per message; the rest are counted
_STOP_TIMEOUT = 5.0  # seconds a stop may take to disconnect the plugins


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``fake-kubelet`` subcommand (``func=run_fake_kubelet``)."""
    p = subparsers.add_parser(
        "fake-kubelet",
        help="run a kubelet simulator to try plugins against, printing what it sees",
        description=(
            "Act as the kubelet on DIR/kubelet.sock until Ctrl-C: accept registrations, keep "
            "every plugin's ListAndWatch stream, and print registrations, capacity changes and "
            "health flips as they happen. Run plugins with --device-plugin-dir DIR. Like a "
            "real kubelet it deletes the other files in DIR when it starts (plugins register "
            "again); SIGHUP restarts it."
        ),
        formatter_class=_cli_probe.HelpFormatter,
        epilog="examples:\n  devplugin fake-kubelet --dir /tmp/kubelet\n"
        "  devplugin run generic --config examples/generic/config.yaml "
        "--device-plugin-dir /tmp/kubelet",
    )
    p.add_argument(
        "--dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="the device-plugin directory to serve (created if missing)",
    )
    p.set_defaults(func=run_fake_kubelet)


def run_fake_kubelet(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run until SIGINT or SIGTERM; return the exit code.

    Raises:
        ConfigError: ``--dir`` cannot be used (not a directory, files a kubelet would delete,
            another kubelet live there).
    """
    directory = Path(args.dir).absolute()
    stale = _check_directory(directory)
    view = _View(out or sys.stdout)
    anyio.run(_serve, directory, stale, view, backend="asyncio")
    return 0


def _check_directory(directory: Path) -> list[str]:
    """Refuse a directory the fake kubelet must not take; return the plugin sockets in it."""
    option = "--dir"
    problem = socket_path_problem(directory / constants.KUBELET_SOCKET_NAME)
    if problem is not None:
        raise ConfigError(option, problem)
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError(option, f"{directory} is not a directory") from None
    except OSError as exc:
        raise ConfigError(option, f"{directory}: {exc.strerror}") from None
    sockets: list[str] = []
    others: list[str] = []
    for entry in entries:
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except OSError:
            continue
        if stat.S_ISSOCK(mode):
            sockets.append(entry.name)
        elif not stat.S_ISDIR(mode) and not entry.name.startswith(constants.CHECKPOINT_NAME):
            others.append(entry.name)
    if others:
        named = ", ".join(sorted(others)[:3]) + (" ..." if len(others) > 3 else "")
        raise ConfigError(
            option,
            f"{directory} holds files that are not sockets ({named}); a kubelet deletes every "
            "file in its directory when it starts: use an empty or new directory",
        )
    if constants.KUBELET_SOCKET_NAME in sockets and _answers(
        directory / constants.KUBELET_SOCKET_NAME
    ):
        raise ConfigError(
            option, f"another kubelet serves {directory / constants.KUBELET_SOCKET_NAME}"
        )
    return sorted(name for name in sockets if name != constants.KUBELET_SOCKET_NAME)


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


async def _serve(directory: Path, stale: list[str], view: _View) -> None:
    # Loaded for this command only: every other command starts faster without it.
    from devplugin_sdk.kubelet import fake as _fake_kubelet  # noqa: PLC0415

    kubelet = _fake_kubelet.FakeKubelet(directory, on_list=view.listed)
    async with kubelet:
        view.say(
            f"fake kubelet serving {kubelet.socket_path} (pid {os.getpid()}); run plugins with "
            f"--device-plugin-dir {directory}; Ctrl-C stops, SIGHUP restarts"
        )
        if stale:
            view.say(
                f"removed {len(stale)} plugin socket(s) left from before ({', '.join(stale)}), "
                "as a starting kubelet does: running plugins register again"
            )
        async with anyio.create_task_group() as tg:
            tg.start_soon(view.follow, kubelet)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as got:
                async for signum in got:
                    if signum != signal.SIGHUP:
                        break
                    view.say("restarting (SIGHUP): every plugin must register again")
                    await kubelet.restart()
            tg.cancel_scope.cancel()
        # Bounded: a plugin in the middle of Register must not keep Ctrl-C waiting (the
        # kubelet's dial-back alone may take 10 s); leaving the block cleans up the rest.
        with anyio.move_on_after(_STOP_TIMEOUT):
            await kubelet.stop()
    view.say("fake kubelet stopped")


class _View:
    """What the kubelet saw last, printed as it changes."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.health: dict[str, dict[str, str]] = {}  # resource -> device -> health string
        self.registered: dict[str, bool] = {}

    def say(self, text: str) -> None:
        # Resource names, IDs and errors come from plugins: no control character reaches the
        # terminal (a forged line, an escape sequence).
        if not text.isprintable():
            text = "".join(
                c if c.isprintable() else c.encode("unicode_escape").decode() for c in text
            )
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        print(f"[{stamp}] {text}", file=self.out, flush=True)

    def listed(self, resource: str, devices: Sequence[_fake_kubelet.KubeletDevice]) -> None:
        """A ListAndWatch message (the kubelet's ``on_list`` hook): capacity and health flips."""
        new = {d.id: d.health for d in devices}
        old = self.health.get(resource)
        self.health[resource] = new
        healthy = sum(1 for d in devices if d.healthy)
        counts = f"capacity {len(new)}, allocatable {healthy}"
        if old is None:
            self.say(f"{resource}: device list: {counts}")
            return
        flips = [f"{i} {old[i]} -> {h}" for i, h in sorted(new.items()) if i in old and old[i] != h]
        added = sorted(new.keys() - old.keys())
        removed = sorted(old.keys() - new.keys())
        for flip in flips[:_MAX_FLIPS]:
            self.say(f"{resource}: device {flip}")
        if len(flips) > _MAX_FLIPS:
            self.say(f"{resource}: and {len(flips) - _MAX_FLIPS} more health changes")
        if added or removed:
            self.say(f"{resource}: {_names('added', added)}{_names('removed', removed)}".rstrip())
        old_healthy = sum(1 for h in old.values() if h == "Healthy")
        if len(new) != len(old) or healthy != old_healthy:
            self.say(f"{resource}: {counts}")

    async def follow(self, kubelet: _fake_kubelet.FakeKubelet) -> None:
        """Print Register calls and streams ending, as the kubelet's state changes."""
        seen = 0

        def changed() -> bool:
            return len(kubelet.registrations) != seen or bool(self._disconnected(kubelet))

        while True:
            await kubelet.wait_for(changed, timeout=math.inf, what="a change")
            for call in kubelet.registrations[seen:]:
                self._registration(call)
            seen = len(kubelet.registrations)
            for resource in self._disconnected(kubelet):
                self.registered[resource] = False
                self.say(
                    f"{resource}: ListAndWatch stream ended: every device counts Unhealthy "
                    "(allocatable 0) until the plugin registers again"
                )

    def _registration(self, call: _fake_kubelet.Registration) -> None:
        if call.error is not None:
            self.say(f"{call.resource_name}: Register refused: {call.error}")
            return
        self.registered[call.resource_name] = True
        self.health.pop(call.resource_name, None)  # its next list is announced in full
        options = [
            name
            for name, on in (
                ("GetPreferredAllocation", call.preferred_allocation),
                ("PreStartContainer", call.pre_start_required),
            )
            if on
        ]
        self.say(
            f"{call.resource_name}: registered (endpoint {call.endpoint}"
            + (f", with {' and '.join(options)}" if options else "")
            + ")"
        )

    def _disconnected(self, kubelet: _fake_kubelet.FakeKubelet) -> list[str]:
        return [r for r, up in self.registered.items() if up and not kubelet.is_registered(r)]


def _names(what: str, ids: list[str]) -> str:
    if not ids:
        return ""
    shown = ", ".join(ids[:_MAX_FLIPS]) + (
        f" and {len(ids) - _MAX_FLIPS} more" if len(ids) > _MAX_FLIPS else ""
    )
    return f"{what} {shown}; "
