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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import yaml

from devplugin_sdk._logging import fatal
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


#: The read cap of a dump of a cluster's objects (``--slices``, the CLAIM files), sized for the
#: largest cluster: one node's slices (8 GPUs with the attributes NVIDIA's driver publishes) take
#: about 18 KB of ``kubectl get resourceslices -o yaml`` (the 1.8 MB dump of ~100 GPU nodes), and
#: Kubernetes supports 5,000 nodes: 90 MB. A configuration file keeps ``MAX_FILE_BYTES`` (1 MiB).
DUMP_BYTES = 96 << 20
#: The YAML node bound scaled to match: such a dump has about one node (list, mapping or value)
#: per 12 bytes. Aliases still count expanded, so an alias bomb is refused as in a configuration.
DUMP_NODES = DUMP_BYTES // 12


@dataclass(frozen=True, slots=True)
class Document:
    """One object of an input file, and where it is (``FILE document N [items[K]]``)."""

    where: str
    obj: Mapping[str, Any]

    @property
    def kind(self) -> object:
        return self.obj.get("kind")

    def named(self) -> str:
        """Where it is, with its kind and name: ``FILE document 2 (ResourceSlice gpu-0)``."""
        meta = self.obj.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        what = " ".join(str(p)[:80] for p in (self.kind, name) if isinstance(p, str))
        return f"{self.where} ({what})" if what else self.where


class Refusals(Exception):
    """Input refused, one line each (``FILE document N (KIND NAME): KEY: why``): objects of
    the wrong shape, selectors the API server would refuse."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def documents(path: str) -> list[Document]:
    """Every object of a multi-document YAML file (a ``List``'s items expanded).

    Raises:
        ConfigError: unreadable, over ``DUMP_BYTES``, or not YAML.
        Refusals: a ``List`` item that is not a mapping.
    """
    text = read_file(path, DUMP_BYTES).decode("utf-8", errors="replace")
    out: list[Document] = []
    wrong: list[str] = []
    for i, part in enumerate(_DOCUMENT_END.split(text)):
        data = parse_yaml(part, f"{path} (document {i + 1})", max_nodes=DUMP_NODES)
        if not data:
            continue
        kind = data.get("kind")
        items = data.get("items") if isinstance(kind, str) and kind.endswith("List") else None
        if not isinstance(items, list):
            out.append(Document(f"{path} document {i + 1}", data))
            continue
        for k, item in enumerate(items):
            where = f"{path} document {i + 1} items[{k}]"
            if isinstance(item, Mapping):
                out.append(Document(where, item))
            else:
                wrong.append(f"{where}: must be a mapping, got {type(item).__name__}")
    if wrong:
        raise Refusals(wrong)
    return out


def _checked(docs: list[Document]) -> None:
    """Refuse objects of the wrong shape (``dra._shapes``): every one, one line each."""
    # Imported here: `devplugin run` builds this parser and never loads the DRA package.
    from devplugin_sdk.dra import _shapes  # noqa: PLC0415

    shapes: dict[str, Callable[[object], list[tuple[str, str]]]] = {
        "ResourceSlice": _shapes.slice_problems,
        "ResourceClaim": _shapes.claim_problems,
        "ResourceClaimTemplate": _shapes.claim_problems,
        "DeviceClass": _shapes.class_problems,
    }
    wrong = []
    for doc in docs:
        check = shapes.get(doc.kind) if isinstance(doc.kind, str) else None
        for key, why in check(doc.obj) if check is not None else ():
            wrong.append(f"{doc.named()}: {key}: {why}")
    if wrong:
        raise Refusals(wrong)


def _slices(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.slices:
        found = [d for d in documents(args.slices) if d.kind == "ResourceSlice"]
        if not found:
            raise ConfigError("--slices", f"{args.slices} holds no ResourceSlice")
        _checked(found)
        return [dict(d.obj) for d in found]
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


def _refused(wrong: Refusals) -> int:
    """Each wrong shape on a line of its own (as ``main`` writes an error); exit code 2."""
    for line in wrong.lines:
        fatal(f"devplugin: error: {line}")
    return 2


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        return _check(args)
    except Refusals as wrong:
        return _refused(wrong)


def _check(args: argparse.Namespace) -> int:
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
    from devplugin_sdk.dra.simulate import SelectorError  # noqa: PLC0415 - only for this command

    try:
        return _simulate(args)
    except Refusals as wrong:
        return _refused(wrong)
    except SelectorError as exc:  # raised outside _simulate's naming: name it plainly
        return _refused(Refusals([f"{d}: {k}: {m}" for d, k, m in exc.refused]))


def _simulate(args: argparse.Namespace) -> int:
    from devplugin_sdk.dra.simulate import SelectorError, plain, simulate  # noqa: PLC0415

    slices = _slices(args)
    objects = [d for path in args.claim for d in documents(path)]
    _checked(objects)
    classes = {_name(d): d for d in objects if d.kind == "DeviceClass"}
    claims = [d for d in objects if d.kind in _CLAIM_KINDS]
    if len(claims) != 1:
        raise ConfigError(
            "CLAIM", f"needs one ResourceClaim or ResourceClaimTemplate, found {len(claims)}"
        )
    (claim,) = claims
    try:
        outcome = simulate(slices, _claim_spec(claim.obj), {n: d.obj for n, d in classes.items()})
    except SelectorError as exc:
        # Each refused selector named in its document: the claim's keys are under the
        # template's spec.spec in a ResourceClaimTemplate.
        template = claim.kind == "ResourceClaimTemplate"
        lines = []
        for document, key, message in exc.refused:
            mine = document == "claim"
            where = claim.named() if mine else classes[document].named()
            lines.append(f"{where}: {'spec.' if template and mine else ''}{key}: {message}")
        raise Refusals(lines) from None
    for line in plain(outcome):
        print(line)
    return 0 if outcome.allocated else 1


def _name(doc: Document) -> str:
    meta = doc.obj.get("metadata")
    return str(meta.get("name")) if isinstance(meta, Mapping) else "None"


_CLAIM_KINDS = ("ResourceClaim", "ResourceClaimTemplate")


def _claim_spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec: Mapping[str, Any] = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    return spec
