"""Per-node configuration chosen by a node label (issue 27, item 6), as NVIDIA's plugin does
with ``nvidia.com/device-plugin.config``: the real command, the label read from a loopback API
server through lightkube, the plugin registering with the FakeKubelet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_process import devplugin, environment, error_line, running
from kube_apiserver import FakeApiServer

from devplugin_sdk.testing import FakeKubelet, MemoryApi

LABEL = "example.com/device-plugin.config"
NODE = "node-a"


def _configs(tmp_path: Path) -> Path:
    """default.yaml (example.com/widget) and big.yaml (example.com/big) in one directory, as a
    ConfigMap with two keys is mounted; returns the default."""
    devices = tmp_path / "dev"
    devices.mkdir()
    for i in range(2):
        (devices / f"widget{i}").touch()
    configs = tmp_path / "configs"
    configs.mkdir()
    for name, resource in (("default", "example.com/widget"), ("big", "example.com/big")):
        (configs / f"{name}.yaml").write_text(
            f"resources:\n  - resourceName: {resource}\n    paths: ['{devices}/w*']\n"
        )
    return configs / "default.yaml"


@pytest.mark.parametrize(
    ("labels", "resource", "file"),
    [({LABEL: "big"}, "example.com/big", "big.yaml"), ({}, "example.com/widget", "default.yaml")],
    ids=["labelled", "unlabelled"],
)
async def test_the_node_label_chooses_the_configuration(
    kubelet: FakeKubelet, tmp_path: Path, labels: dict[str, str], resource: str, file: str
) -> None:
    default = _configs(tmp_path)
    server = FakeApiServer(MemoryApi(nodes=[NODE]))
    server.node_labels[NODE] = labels
    async with server.serving():
        env = {
            **environment(),
            "NODE_NAME": NODE,
            "KUBECONFIG": str(server.kubeconfig(tmp_path / "kubeconfig")),
            "DEVPLUGIN_NODE_CONFIG_LABEL": LABEL,
        }
        async with running(
            "run", "generic", "--config", str(default), "--device-plugin-dir",
            str(kubelet.directory), env=env,
        ) as plugin:  # fmt: skip
            await kubelet.wait_for_allocatable(resource, 2, timeout=15)
            chosen = await plugin.wait_for_line("configuration chosen by the node label")
            starting = await plugin.wait_for_line("starting:")
            assert await plugin.stop() == 0, plugin.error_output
    assert chosen.endswith(str(default.parent / file))
    assert f"config {default.parent / file}" in starting


async def test_a_label_naming_no_file_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = _configs(tmp_path)
    server = FakeApiServer(MemoryApi(nodes=[NODE]))
    server.node_labels[NODE] = {LABEL: "huge"}
    async with server.serving():
        monkeypatch.setenv("NODE_NAME", NODE)
        monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig(tmp_path / "kubeconfig")))
        result = await _devplugin_in_thread(
            "run", "generic", "--config", str(default), "--node-config-label", LABEL,
            "--device-plugin-dir", str(tmp_path),
        )  # fmt: skip
    assert error_line(result) == (
        f"devplugin: error: --node-config-label: node {NODE} has {LABEL}=huge, but neither "
        f"huge.yaml nor huge is in {default.parent} (there: big.yaml, default.yaml)"
    )


def test_without_node_name_the_option_says_what_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    default = _configs(tmp_path)
    line = error_line(
        devplugin("run", "generic", "--config", str(default), "--node-config-label", LABEL)
    )
    assert line == (
        "devplugin: error: --node-config-label: needs the node's name in $NODE_NAME "
        "(the downward API: fieldRef spec.nodeName)"
    )


async def _devplugin_in_thread(*args: str) -> object:
    """``devplugin(...)`` off the event loop, which serves the API server meanwhile."""
    import anyio.to_thread

    return await anyio.to_thread.run_sync(lambda: devplugin(*args))
