"""The kubelet's rules for a DRA registration, checked at start: ``devplugin run`` exits 2 with
one line when the DRA socket is outside the kubelet's root directory or too long for a unix
socket, or the driver name is not a DNS subdomain of at most 63 characters (real subprocesses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_process import devplugin, error_line

from devplugin_sdk.dra import Dra
from devplugin_sdk.dra._rules import endpoint_problem
from devplugin_sdk.testing import FakeKubelet, MemoryApi, StaticPlugin, serving


def run_file(tmp_path: Path, **dra: object) -> Path:
    registry = tmp_path / "kubelet" / "plugins_registry"
    registry.mkdir(parents=True, exist_ok=True)
    config = {
        "backend": "cli_target:TwoWidgets",
        "api": "dra",
        "pluginsRegistryDir": str(registry),
        "dra": {"driver": "widget.acme.com", "nodeName": "node-1", **dra},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


def test_a_dra_socket_outside_the_kubelet_root_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = run_file(tmp_path, pluginDir=str(tmp_path / "elsewhere" / "widget"))
    line = error_line(devplugin("run", "--config", str(config)))
    assert "outside the kubelet's root directory" in line
    assert str(tmp_path / "kubelet") in line
    assert "dra.pluginDir" in line


def test_kubelet_root_dir_names_the_root_explicitly(tmp_path: Path) -> None:
    config = run_file(
        tmp_path,
        pluginDir=str(tmp_path / "kubelet" / "plugins" / "widget"),
        kubeletRootDir=str(tmp_path / "other-root"),
    )
    line = error_line(devplugin("run", "--config", str(config)))
    assert str(tmp_path / "other-root") in line


def test_a_dra_socket_path_over_107_bytes_is_one_line_and_exit_2(tmp_path: Path) -> None:
    deep = tmp_path / "kubelet" / "plugins" / ("d" * 120)
    config = run_file(tmp_path, pluginDir=str(deep))
    line = error_line(devplugin("run", "--config", str(config)))
    assert "bytes long; a unix socket path holds at most 107" in line


@pytest.mark.parametrize(
    ("driver", "why"),
    [("a" * 64 + ".com", "longer than 63"), ("Widget_Acme", "DNS-1123 subdomain")],
)
def test_a_driver_name_the_kubelet_refuses_is_one_line_and_exit_2(
    tmp_path: Path, driver: str, why: str
) -> None:
    config = run_file(tmp_path, driver=driver)
    line = error_line(devplugin("run", "--config", str(config)))
    assert "dra.driver" in line
    assert why in line


def test_the_rules_as_the_kubelet_states_them() -> None:
    root = Path("/var/lib/kubelet")
    assert endpoint_problem(root / "plugins/gpu.acme.com/dra.sock", root) is None
    assert "absolute" in (endpoint_problem(Path("plugins/dra.sock"), root) or "")
    assert "'..'" in (endpoint_problem(root / "plugins/../../../tmp/dra.sock", root) or "")
    assert "outside" in (endpoint_problem(Path("/var/lib/kubelet2/dra.sock"), root) or "")
    at_limit = root / ("x" * (107 - len("/var/lib/kubelet/")))
    assert len(str(at_limit)) == 107
    assert endpoint_problem(at_limit, root) is None
    assert "108 bytes" in (endpoint_problem(Path(str(at_limit) + "x"), root) or "")


async def test_serve_refuses_the_same_before_starting_anything(tmp_path: Path) -> None:
    api = MemoryApi(nodes=["node-1"])
    async with FakeKubelet(dra_api=api) as kubelet:
        options = Dra(
            driver="widget.acme.com",
            node_name="node-1",
            api=api,
            plugin_dir=tmp_path / "outside",
            cdi_dir=tmp_path / "cdi",
        )
        with pytest.raises(ValueError, match="outside the kubelet's root directory"):
            async with serving(
                StaticPlugin("acme.com/widget", []),
                settings=kubelet.settings(),
                api="dra",
                dra=options,
            ):
                pass
        assert not (tmp_path / "outside").exists()
