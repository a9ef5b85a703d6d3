"""``devplugin dra check`` and ``devplugin dra simulate``: a driver's slices and a claim, offline.

``check`` prints the ResourceSlices the configured plugins would publish (``--config``, the
``devplugin run`` file: its backend discovers the node's devices) or reads them from a file
(``--slices``, e.g. ``kubectl get resourceslices -o yaml``), and validates them against the
resource.k8s.io/v1 rules of Kubernetes 1.34-1.37 (``dra.check``); exit 1 on a violation.
``simulate`` says which devices the scheduler would pick for a claim from those slices, or why it
cannot (``dra.simulate``; the ``cel`` extra). Neither talks to a cluster.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

import anyio
import yaml

from devplugin_sdk.config import parse_yaml, read_file
from devplugin_sdk.errors import ConfigError

__all__ = ["register"]

_DOCUMENT_END = re.compile(r"^---[ \t]*$", re.MULTILINE)


def register(sub: Any) -> None:
    """Add ``check`` and ``simulate`` to the ``devplugin dra`` group's subparsers."""
    check = sub.add_parser(
        "check",
        help="print the slices a configuration would publish and validate them for 1.34-1.37",
        description="Print the ResourceSlices the configured plugins would publish on this node "
        "(or those of --slices) and check them against the resource.k8s.io/v1 rules of "
        "Kubernetes 1.34 to 1.37; exit 1 when a version would refuse one. Offline.",
    )
    _sources(check)
    check.add_argument("--quiet", action="store_true", help="print the problems only")
    check.set_defaults(func=_cmd_check)
    simulate = sub.add_parser(
        "simulate",
        help="say which devices the scheduler would pick for a claim",
        description="Evaluate a claim's requests (CEL selectors, counts, capacity, "
        "matchAttribute, counters) against the slices, as the scheduler's allocator does, and "
        "print the devices picked or why none can be; exit 1 when none. CLAIM is a YAML file "
        "(or several) with the ResourceClaim or ResourceClaimTemplate and the DeviceClasses it "
        "names. "
        "Needs devplugin-sdk[cel].",
    )
    _sources(simulate)
    simulate.add_argument(
        "claim", metavar="CLAIM", nargs="+", help="YAML: the claim and its DeviceClasses"
    )
    simulate.set_defaults(func=_cmd_simulate)


def _sources(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config", metavar="FILE", help="the devplugin run file (api: dra)")
    group.add_argument("--slices", metavar="FILE", help="ResourceSlices as YAML")
    parser.add_argument(
        "--node", default=None, help="the node name for --config (default $NODE_NAME or 'node')"
    )


def documents(path: str) -> list[Mapping[str, Any]]:
    """Every object of a multi-document YAML file (a ``List``'s items expanded)."""
    text = read_file(path).decode("utf-8", errors="replace")
    out: list[Mapping[str, Any]] = []
    for i, part in enumerate(_DOCUMENT_END.split(text)):
        data = parse_yaml(part, f"{path} (document {i + 1})")
        if not data:
            continue
        items = data.get("items") if data.get("kind", "").endswith("List") else None
        out.extend(items if isinstance(items, list) else [data])
    return out


def _slices(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.slices:
        found = [dict(d) for d in documents(args.slices) if d.get("kind") == "ResourceSlice"]
        if not found:
            raise ConfigError("--slices", f"{args.slices} holds no ResourceSlice")
        return found
    return anyio.run(_configured_slices, args.config, args.node)


async def _configured_slices(path: str, node: str | None) -> list[dict[str, Any]]:
    """The slices ``devplugin run --config path`` would publish: its plugins served by the
    driver itself, against an in-memory API in a private directory (no kubelet is asked; the
    pool is published before the driver registers), so shares, partitions, counter sets and the
    split into slices are exactly the driver's."""
    # Imported here: the command's own modules (cold start of `devplugin run`).
    import dataclasses  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from devplugin_sdk import runner  # noqa: PLC0415
    from devplugin_sdk.cli import resolve_plugins  # noqa: PLC0415
    from devplugin_sdk.cli.runfile import parse_run_config  # noqa: PLC0415
    from devplugin_sdk.config import load_yaml  # noqa: PLC0415
    from devplugin_sdk.dra._pool import plugins as _plugins  # noqa: PLC0415
    from devplugin_sdk.dra.check import slice_objects  # noqa: PLC0415
    from devplugin_sdk.kubelet.memory_api import MemoryApi  # noqa: PLC0415
    from devplugin_sdk.settings import Settings  # noqa: PLC0415

    config = parse_run_config(await anyio.to_thread.run_sync(load_yaml, path))
    if config.dra is None or config.backend is None:
        raise ConfigError("dra", f"{path} has no dra section (api: dra or both) or no backend")
    node_name = node or config.dra.node_name or os.environ.get("NODE_NAME") or "node"
    plugins = resolve_plugins(config.backend, config.backend_options)
    api = MemoryApi(nodes=[node_name])
    driver = config.dra.driver
    with tempfile.TemporaryDirectory(prefix="dra-check-", dir="/tmp") as tmp:
        root = Path(tmp)
        options = dataclasses.replace(
            config.dra,
            node_name=node_name,
            api=api,
            kubeconfig=None,
            plugin_dir=root / "plugins" / driver,
            cdi_dir=root / "cdi",
            kubelet_root_dir=root,
        )
        settings = Settings(
            device_plugin_dir=root / "device-plugins",
            plugins_registry_dir=root / "plugins_registry",
            registration="watcher",
        )
        async with anyio.create_task_group() as tg:
            await tg.start(_serve, plugins, settings, options, runner)
            # Every plugin discovers first, or the driver's own bound on waiting for them.
            with anyio.fail_after(_plugins.FIRST_LIST_WAIT + 10):
                while not api.pool_complete(driver, node_name):
                    await api.wait_changed(api.generation)
            tg.cancel_scope.cancel()
    return slice_objects(sorted(api.slices.values(), key=lambda s: s.name))


async def _serve(
    plugins: Any, settings: Any, options: Any, runner: Any, *, task_status: Any
) -> None:
    await runner.serve(*plugins, settings=settings, api="dra", dra=options, task_status=task_status)


def _cmd_check(args: argparse.Namespace) -> int:
    from devplugin_sdk.dra.check import check_slices  # noqa: PLC0415 - only for this command

    slices = _slices(args)
    if not args.quiet:
        sys.stdout.write(yaml.safe_dump_all(slices, sort_keys=False))
        sys.stdout.write("---\n")
    problems = check_slices(slices)
    errors = [p for p in problems if p.severity == "error"]
    for problem in problems:
        print(problem)
    devices = sum(len((s.get("spec") or {}).get("devices") or []) for s in slices)
    print(
        f"{len(slices)} slices, {devices} devices: {len(errors)} errors, "
        f"{len(problems) - len(errors)} warnings (Kubernetes 1.34-1.37)"
    )
    return 1 if errors else 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from devplugin_sdk.dra.simulate import plain, simulate  # noqa: PLC0415 - only for this command

    slices = _slices(args)
    objects = [d for path in args.claim for d in documents(path)]
    classes = {
        str((d.get("metadata") or {}).get("name")): d
        for d in objects
        if d.get("kind") == "DeviceClass"
    }
    claims = [_claim_spec(d) for d in objects if d.get("kind") in _CLAIM_KINDS]
    if len(claims) != 1:
        raise ConfigError(
            "CLAIM", f"needs one ResourceClaim or ResourceClaimTemplate, found {len(claims)}"
        )
    outcome = simulate(slices, claims[0], classes)
    for line in plain(outcome):
        print(line)
    return 0 if outcome.allocated else 1


_CLAIM_KINDS = ("ResourceClaim", "ResourceClaimTemplate")


def _claim_spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec: Mapping[str, Any] = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    return spec
