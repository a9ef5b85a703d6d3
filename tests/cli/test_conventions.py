"""What a plugin author and an operator meet when something goes wrong (issue 27, items 2, 7, 8).

Each test runs the friction the way a new user meets it: their own module in a fresh directory,
``devplugin`` as a subprocess, the fake kubelet; it asserts the exit code and our own words.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from cli_process import devplugin, environment, running

from devplugin_sdk import Device, DevicePlugin, serve
from devplugin_sdk._engine import hooks
from devplugin_sdk.cli import build_parser
from devplugin_sdk.testing import FakeKubelet

ROOT = Path(__file__).resolve().parents[2]

# A new user's module: one class per way a hook goes wrong.
PLUGINS = '''
import anyio
import anyio.to_thread
from devplugin_sdk import Device, DevicePlugin

class Failing(DevicePlugin):
    resource_name = "acme.com/widget"

    async def discover(self):
        raise RuntimeError("cannot open /dev/boomctl: permission denied")

class Missing(DevicePlugin):
    resource_name = "acme.com/widget"

    async def discover(self):
        return {}["widgets"]

class Plain(DevicePlugin):
    resource_name = "acme.com/widget"

    def discover(self):
        return [Device(id="w0")]

class PlainStop(DevicePlugin):
    resource_name = "acme.com/widget"

    async def discover(self):
        return [Device(id="w0")]

    def on_stop(self):
        pass

class Sick(DevicePlugin):
    resource_name = "acme.com/widget"

    async def discover(self):
        return [Device(id="w0")]

    async def check_health(self, devices):
        raise RuntimeError("sensor gone")

class Unloaded(DevicePlugin):
    resource_name = "acme.com/widget"

    def __init__(self):
        from devplugin_sdk.errors import BackendError
        raise BackendError("vendor library not loaded")

    async def discover(self):
        return []

class Nameless(DevicePlugin):
    async def discover(self):
        return []

class Fine(DevicePlugin):
    resource_name = "acme.com/widget"

    async def discover(self):
        return [Device(id="w0")]

def _read(path):
    with open(path) as fifo:
        return fifo.read()

class Slow(DevicePlugin):
    """discover() waits (off the loop) until the test writes to the FIFO."""
    resource_name = "acme.com/widget"

    async def discover(self):
        await anyio.to_thread.run_sync(_read, "gate")
        return [Device(id="w0")]

class Blocking(DevicePlugin):
    """discover() blocks the event loop until the test writes to the FIFO."""
    resource_name = "acme.com/widget"

    async def discover(self):
        _read("gate")
        return [Device(id="w0")]
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "acme.py").write_text(PLUGINS)
    (tmp_path / "kubelet").mkdir()
    return tmp_path


def _run(project: Path, target: str, *options: str) -> subprocess.CompletedProcess[str]:
    return devplugin(
        *options,
        "run",
        f"acme:{target}",
        "--registration",
        "kubelet",
        "--device-plugin-dir",
        str(project / "kubelet"),
        cwd=project,
    )


def _one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    # The routine INFO lines of a start (the startup line, "discovered N devices") are not the
    # failure's: what ends the command is the one line left.
    routine = (" INFO ", "discovered")
    lines = [line for line in result.stderr.splitlines() if not any(r in line for r in routine)]
    assert len(lines) == 1, result.stderr
    return lines[0]


# ------------------------------------------------------------------ item 2: hook errors


@pytest.mark.parametrize(
    ("target", "line"),
    [
        (
            "Failing",
            "devplugin: error: acme.com/widget: discover() failed: RuntimeError: "
            "cannot open /dev/boomctl: permission denied",
        ),
        ("Missing", "devplugin: error: acme.com/widget: discover() failed: KeyError: 'widgets'"),
    ],
)
def test_a_failing_hook_is_one_line_naming_resource_hook_and_error(
    project: Path, target: str, line: str
) -> None:
    assert _one_line(_run(project, target), 1) == line


def test_an_error_building_the_plugin_says_what_raised_it(project: Path) -> None:
    assert _one_line(_run(project, "Unloaded"), 1) == (
        "devplugin: error: acme:Unloaded: Unloaded() failed: BackendError: "
        "vendor library not loaded"
    )


def test_the_traceback_comes_at_log_level_debug(project: Path) -> None:
    result = _run(project, "Failing", "--log-level", "debug")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert 'acme.py", line 10, in discover' in result.stderr
    assert result.stderr.count("Traceback (most recent call last)") == 1
    assert (
        result.stderr.rstrip()
        .splitlines()[-1]
        .startswith("devplugin: error: acme.com/widget: discover() failed: RuntimeError")
    )


@pytest.mark.parametrize(
    ("level", "traceback"), [("info", False), ("debug", True)], ids=["info", "debug"]
)
async def test_a_hook_failing_while_serving_is_one_log_line_its_traceback_at_debug(
    project: Path, level: str, traceback: bool
) -> None:
    async with running(
        "--log-level", level, "run", "acme:Sick", "--registration", "kubelet",
        "--device-plugin-dir", str(project / "kubelet"), cwd=project,
    ) as proc:  # fmt: skip
        line = await proc.wait_for_line("check_health failed")
        assert (
            line.endswith(
                "devplugin_sdk: acme.com/widget: check_health failed; health unchanged: "
                "RuntimeError: sensor gone"
            )
            != traceback
        )
        if traceback:
            await proc.wait_for_line("Traceback (most recent call last)")
        proc.signal(signal.SIGTERM)
        assert await proc.exited() == 0
    assert ("Traceback" in proc.text()) == traceback


@pytest.mark.parametrize(("target", "hook"), [("Plain", "discover"), ("PlainStop", "on_stop")])
def test_a_hook_that_is_not_async_is_refused_with_a_line_that_says_async_def(
    project: Path, target: str, hook: str
) -> None:
    line = _one_line(_run(project, target), 2)
    assert line == (
        f"devplugin: error: acme.{target}.{hook} must be defined with async def "
        f"(hooks are coroutines; run blocking work through anyio.to_thread.run_sync)"
    )


def test_a_plugin_without_resource_name_is_one_line(project: Path) -> None:
    line = _one_line(_run(project, "Nameless"), 2)
    assert line == "devplugin: error: Nameless must set resource_name to a string"


def test_a_syntax_error_in_the_module_is_one_line(project: Path) -> None:
    (project / "broken.py").write_text("def discover(:\n")
    result = devplugin("run", "broken:Plugin", cwd=project)
    assert _one_line(result, 2) == (
        "devplugin: error: target: cannot import 'broken': "
        "SyntaxError: invalid syntax (broken.py, line 1)"
    )


# ------------------------------------------------------------------ item 7: CLI conventions


def test_the_fatal_line_is_json_under_log_format_json(project: Path) -> None:
    result = _run(project, "Failing", "--log-format", "json")
    assert result.returncode == 1
    last = json.loads(result.stderr.strip().splitlines()[-1])
    assert last["level"] == "error"
    assert last["message"] == (
        "acme.com/widget: discover() failed: RuntimeError: "
        "cannot open /dev/boomctl: permission denied"
    )
    for line in result.stderr.strip().splitlines():
        json.loads(line)  # every line


def test_a_config_error_under_json_is_json_and_exits_2(tmp_path: Path) -> None:
    result = devplugin("--log-format", "json", "run", "generic", "--config", str(tmp_path / "no"))
    assert result.returncode == 2
    record = json.loads(result.stderr)
    assert (record["level"], record["message"]) == (
        "error",
        f"{tmp_path / 'no'}: cannot read: No such file or directory",
    )


def test_probe_errors_go_to_stderr(tmp_path: Path) -> None:
    result = devplugin("probe", "--socket", str(tmp_path / "nope.sock"))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"devplugin: error: no socket at {tmp_path}")


def test_demo_into_a_closed_pipe_exits_quietly() -> None:
    """``devplugin demo | head -1``: the reader goes away; no Broken pipe, exit 0."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(),
    )
    assert demo.stdout is not None
    assert demo.stdout.readline()
    demo.stdout.close()  # `head -1` exits
    _, err = demo.communicate(timeout=30)
    assert (demo.returncode, err.decode()) == (0, "")


async def test_ctrl_c_while_conformance_waits_exits_130(tmp_path: Path) -> None:
    async with running("conformance", "--register-dir", str(tmp_path)) as proc:
        await proc.wait_for("waiting for a plugin to register", stream="stdout")
        proc.signal(signal.SIGINT)
        assert await proc.exited() == 130


def test_a_socket_path_over_107_bytes_is_one_line(project: Path) -> None:
    deep = project / ("d" * (108 - len(str(project))))
    deep.mkdir()
    result = devplugin(
        "run", "acme:Fine", "--registration", "kubelet", "--device-plugin-dir", str(deep),
        cwd=project,
    )  # fmt: skip
    line = _one_line(result, 2)
    assert line.startswith(f"devplugin: error: --device-plugin-dir: {deep}/kubelet.sock is ")
    assert line.endswith(" bytes long; a Unix socket path holds at most 107")


def test_fake_kubelet_with_a_socket_path_over_107_bytes_is_one_line(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (108 - len(str(tmp_path))))
    result = devplugin("fake-kubelet", "--dir", str(deep))
    line = _one_line(result, 2)
    assert line.startswith(f"devplugin: error: --dir: {deep}/kubelet.sock is ")


SUBCOMMANDS = ("run", "demo", "fake-kubelet", "probe", "conformance")


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help_with_defaults_and_an_example(command: str) -> None:
    result = devplugin(command, "--help")
    assert result.returncode == 0
    text = result.stdout
    assert "example" in text.lower(), text
    assert f"devplugin {command}" in text.split("xample", 1)[1]
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    assert sub.description
    one_of = [a for g in sub._mutually_exclusive_groups if g.required for a in g._group_actions]
    for action in sub._actions:
        if action.help in (None, "==SUPPRESS==") or not action.option_strings or action in one_of:
            continue
        if action.nargs == 0 or action.required or action.dest in ("log_level", "log_format"):
            continue  # flags, required options, the global options (said on devplugin --help)
        assert "default" in (action.help % vars(action)), (command, action.option_strings)


# ------------------------------------------------------------------ item 8: long waits


async def test_a_slow_discover_says_it_is_still_running(project: Path) -> None:
    os.mkfifo(project / "gate")
    async with running(
        "run", "acme:Slow", "--registration", "kubelet",
        "--device-plugin-dir", str(project / "kubelet"), cwd=project,
    ) as proc:  # fmt: skip
        line = await proc.wait_for_line("still running", timeout=20)
        assert "acme.com/widget: discover() still running after 5s" in line
        await anyio.to_thread.run_sync((project / "gate").write_text, "go")
        await proc.wait_for_line("discovered 1 devices")


async def test_a_blocked_event_loop_is_reported_with_where_it_blocks(project: Path) -> None:
    os.mkfifo(project / "gate")
    async with running(
        "run", "acme:Blocking", "--registration", "kubelet",
        "--device-plugin-dir", str(project / "kubelet"), cwd=project,
    ) as proc:  # fmt: skip
        line = await proc.wait_for_line("event loop", timeout=20)
        assert "the event loop has not run for " in line
        assert f"{project / 'acme.py'}" in line
        assert "in _read" in line
        await anyio.to_thread.run_sync((project / "gate").write_text, "go")
        await proc.wait_for_line("discovered 1 devices")
        await proc.wait_for_line("the event loop runs again")


class _Stuck(DevicePlugin):
    resource_name = "acme.com/widget"

    async def discover(self) -> Sequence[Device]:
        return [Device(id="w0")]

    async def on_stop(self) -> None:
        await anyio.sleep_forever()


async def test_an_on_stop_that_times_out_is_logged(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hooks, "STILL_RUNNING_AFTER", 0.1)
    settings = kubelet.settings(stop_timeout=0.5)
    with caplog.at_level(logging.INFO, logger="devplugin_sdk"):
        async with anyio.create_task_group() as tg:
            await tg.start(partial(serve, _Stuck(), settings=settings))
            tg.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert "acme.com/widget: on_stop() still running after 0.1s" in messages
    assert "acme.com/widget: on_stop() did not finish within 0.5s; left behind" in messages


def test_the_cli_help_of_run_shows_an_example_that_names_a_real_backend() -> None:
    text = devplugin("run", "--help").stdout
    example = text.split("xample", 1)[1]
    assert "devplugin run generic --config" in example
    textwrap.dedent(example)  # readable as is
