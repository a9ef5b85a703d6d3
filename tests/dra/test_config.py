"""`api:` and the `dra:` section of devplugin run's configuration file."""

from __future__ import annotations

from pathlib import Path

import pytest

from devplugin_sdk import Device
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.errors import ConfigError


def test_the_default_is_the_device_plugin_api() -> None:
    config = parse_run_config({"backend": "generic"})
    assert (config.api, config.dra) == ("devicePlugin", None)


def test_a_dra_section_builds_the_driver() -> None:
    config = parse_run_config(
        {
            "api": "both",
            "dra": {
                "driver": "gpu.acme.com",
                "nodeName": "node-7",
                "kubeconfig": "/etc/kube/config",
                "cdiDir": "/run/cdi",
                "devices": [
                    {"resource": "acme.com/gpu", "attributes": {"index": [4, 5]}},
                    {"ids": ["GPU-9*"]},
                ],
            },
        }
    )
    dra = config.dra
    assert config.api == "both"
    assert dra is not None
    assert (dra.driver, dra.node_name, dra.kubeconfig, dra.cdi_dir) == (
        "gpu.acme.com",
        "node-7",
        Path("/etc/kube/config"),
        Path("/run/cdi"),
    )
    assert dra.resolved_plugin_dir == Path("/var/lib/kubelet/plugins/gpu.acme.com")
    four = Device("GPU-1", attributes={"index": 4})
    assert dra.selects("acme.com/gpu", four)
    assert not dra.selects("acme.com/other", four)
    assert not dra.selects("acme.com/gpu", Device("GPU-2", attributes={"index": 1}))
    assert dra.selects("acme.com/other", Device("GPU-91"))
    assert "dra" not in config.backend_options


@pytest.mark.parametrize(
    ("data", "key", "reason"),
    [
        ({"api": "dra"}, "dra", "required with api: dra"),
        ({"dra": {"driver": "a.b"}}, "dra", "api is devicePlugin"),
        ({"api": "DRA"}, "api", "one of devicePlugin, dra, both"),
        ({"api": "dra", "dra": {}}, "dra.driver", "required"),
        ({"api": "dra", "dra": {"driver": "Acme_GPU"}}, "dra.driver", "DNS-1123"),
        ({"api": "dra", "dra": {"driver": "a.b", "drivr": 1}}, "dra.drivr", "did you mean"),
        ({"api": "dra", "dra": {"driver": "a.b", "cdiDir": "run/cdi"}}, "dra.cdiDir", "absolute"),
        ({"api": "dra", "dra": {"driver": "a.b", "devices": [{}]}}, "dra.devices[0]", "every"),
        (
            {"api": "dra", "dra": {"driver": "a.b", "devices": [{"attributes": {"1x": 1}}]}},
            "dra.devices[0].attributes.1x",
            "C identifier",
        ),
    ],
)
def test_mistakes_name_the_key(data: dict[str, object], key: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as caught:
        parse_run_config(data)
    assert caught.value.key == key


def test_a_dra_change_needs_a_restart() -> None:
    old = parse_run_config({"api": "dra", "dra": {"driver": "a.b"}})
    new = parse_run_config({"api": "dra", "dra": {"driver": "a.c"}})
    same = parse_run_config({"api": "dra", "dra": {"driver": "a.b"}})
    assert old.restart_needed(new) == ["dra"]
    assert old.restart_needed(same) == []
