"""Helpers of the DRA tests: the driver name most of them serve as, a stand-in ``nvidia-smi``
for the NVIDIA backend's claim configuration, and a ``devplugin run`` process serving a node's
driver through a real API server."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cli_process import environment

from devplugin_sdk.testing import DraNode

DRIVER = "widget.acme.com"


def fake_nvidia_smi(tmp_path: Path) -> tuple[tuple[str, ...], Path]:
    """A stand-in ``nvidia-smi`` (a real process) that appends its arguments to a log, one line
    a call; it fails (exit 3) for an argument containing ``GPU-fail``."""
    log = tmp_path / "nvidia-smi.log"
    script = tmp_path / "nvidia-smi.py"
    script.write_text(
        "import sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "sys.exit(3 if 'GPU-fail' in ' '.join(sys.argv) else 0)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return (sys.executable, str(script)), log


def calls(log: Path) -> list[str]:
    """The recorded ``nvidia-smi`` calls, and the log emptied."""
    said = log.read_text().splitlines() if log.exists() else []
    log.write_text("")
    return said


def driver_run_file(
    path: Path, node: DraNode, kubeconfig: Path, dev: Path, *, api: str = "dra", **dra: Any
) -> Path:
    """Write at ``path`` a ``devplugin run`` file that serves ``dev``'s ``ttyUSB*`` files (the
    generic backend, ``example.com/serial``) as ``node``'s driver, through the API server of
    ``kubeconfig``, with ``node``'s kubelet, plugin and CDI directories; ``dra`` adds keys of its
    ``dra`` section (``cleanupInterval=10``)."""
    section = {
        "driver": node.driver,
        "nodeName": node.node_name,
        "kubeconfig": str(kubeconfig),
        "pluginDir": str(node.options.plugin_dir),
        "cdiDir": str(node.options.cdi_dir),
        **dra,
    }
    run = {
        "backend": "generic",
        "pluginsRegistryDir": str(node.kubelet.registry_directory),
        "api": api,
        "dra": section,
        "resources": [{"resourceName": "example.com/serial", "paths": [f"{dev}/ttyUSB*"]}],
    }
    path.write_text(json.dumps(run))
    return path


def devplugin_process(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m devplugin_sdk ARGS`` started, with ``env`` added to the test's environment,
    its output piped (stop it yourself)."""
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**environment(), **(env or {})},
    )
