"""What a running pod holds is never lost, and names stay inside their directories (issue 36, rows
1, 2, 3, 4 and 6).

Each test runs the real driver (real gRPC on unix sockets, real files) against FakeKubelet's DRA
side and the in-memory API, row 1 through the loopback API server and the real client. Figures are
printed on lines starting with ``figures`` (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from dra_helpers import DRIVER
from kube_apiserver import FakeApiServer
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim
from devplugin_sdk._wire.dra_service import DraClient
from devplugin_sdk.dra import Dra
from devplugin_sdk.dra._kube import LightkubeApi
from devplugin_sdk.dra.resources import ResourceClaim
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet.fake_dra import DraPod, PodPreparationError
from devplugin_sdk.testing import DraNode, MemoryApi, StaticPlugin

pytestmark = pytest.mark.timeout(60)

Odd = Callable[[ResourceClaim], ResourceClaim]


class OddAnswers(MemoryApi):
    """A MemoryApi whose next claim reads are answered by ``odd`` (one function per read)."""

    def __init__(self, nodes: Sequence[str]) -> None:
        super().__init__(nodes)
        self.odd: list[Odd] = []

    async def read_claim(self, namespace: str, name: str) -> ResourceClaim:
        claim = await super().read_claim(namespace, name)
        return self.odd.pop(0)(claim) if self.odd else claim


def not_found(claim: ResourceClaim) -> ResourceClaim:
    raise KubeApiError(404, f'resourceclaims.resource.k8s.io "{claim.name}" not found')


def unreserved(claim: ResourceClaim) -> ResourceClaim:
    return replace(claim, reserved_for=())


def without_uid(claim: ResourceClaim) -> ResourceClaim:
    """An answer that could not be read as the claim (its UID missing)."""
    return replace(claim, uid="")


def another_object(claim: ResourceClaim) -> ResourceClaim:
    """An answer for another object than the one asked for (a misrouting proxy)."""
    return replace(claim, name="other", uid="0000-other")


async def prepare_one(node: DraNode, claim: str, device: str) -> DraPod:
    pod = node.pod(claim)
    node.claim(claim, {"widgets": [device]}, pods=[pod])
    await node.prepare(pod)
    return pod


@asynccontextmanager
async def client(options: Dra) -> AsyncIterator[DraClient]:
    """The kubelet's DRA client on the driver's socket, for calls FakeKubelet would not make."""
    async with grpc.aio.insecure_channel(f"unix:{options.resolved_plugin_dir}/dra.sock") as ch:
        yield DraClient(ch, "v1.DRAPlugin")


def resolves(cdi_dir: Path, cdi_id: str) -> bool:
    """Whether a spec in ``cdi_dir`` defines the CDI device ``cdi_id`` (``kind=name``), as the
    container runtime looks it up."""
    kind, _, name = cdi_id.partition("=")
    for path in cdi_dir.glob("*.json"):
        spec = json.loads(path.read_text())
        if spec.get("kind") == kind and any(d["name"] == name for d in spec["devices"]):
            return True
    return False


def files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


# ----------------------------------------------------------------------------- row 1


async def test_one_odd_sweep_read_never_unprepares_a_running_pods_claim(tmp_path: Path) -> None:
    """A single 404 between normal answers, one read whose ``reservedFor`` is briefly empty, one
    answer that is not the claim asked for: the claim keeps its CDI spec (today: unprepared at
    the first odd read)."""
    api = OddAnswers(["node-1"])
    async with FakeApiServer(api).serving() as server:
        kube = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            async with DraNode(
                StaticPlugin(RESOURCE, widgets(2)),
                driver=DRIVER,
                memory=api,
                api=kube,
                cleanup_interval=0.05,
            ) as node:
                await prepare_one(node, "running", "w0")
                uid = api.claims[("default", "running")].uid
                for odd in (not_found, unreserved, without_uid, another_object):
                    reads = api.calls.get("read_claim", 0)
                    api.odd.append(odd)
                    # The odd read, then three sweeps that read the claim as it is.
                    await node.kubelet.wait_for(
                        lambda reads=reads: (
                            api.calls.get("read_claim", 0) >= reads + 4
                            or not node.spec_path(uid).exists()
                        ),
                        what="four sweeps",
                    )
                    assert node.spec_path(uid).exists(), f"unprepared after one {odd.__name__}"
                assert node.status.prepared_claims == 1
                assert node.status.stale_claims_unprepared == 0
                # A claim the API really lost is still unprepared, at the second read.
                api.delete_claim("default", "running")
                await node.kubelet.wait_for(
                    lambda: not node.spec_path(uid).exists(), what="unprepared once gone"
                )
        finally:
            await kube.aclose()


# ----------------------------------------------------------------------------- row 2


async def test_unpreparing_an_old_claim_keeps_the_new_claim_of_that_name_its_metadata() -> None:
    """A claim deleted and re-created under its name (a new UID): unpreparing the old one must
    not take the new one's bind-mounted metadata file (today: 1 file -> 0)."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        await prepare_one(node, "c", "w0")
        old = node.api.claims[("default", "c")]
        node.api.delete_claim("default", "c")
        await prepare_one(node, "c", "w1")  # a new pod, a new claim object of the same name
        new = node.api.claims[("default", "c")]
        assert new.uid != old.uid
        mounts = node.spec(new).devices[0]["containerEdits"]["mounts"]
        (metadata,) = [Path(m["hostPath"]) for m in mounts if m["hostPath"].endswith(".json")]
        assert json.loads(metadata.read_text())["metadata"]["uid"] == new.uid
        async with client(node.options) as dra:
            errors = await dra.unprepare([ClaimRef("default", old.uid, "c")], timeout=5)
        assert errors == {old.uid: ""}
        print(f"figures: row 2: metadata files of the new claim after: {int(metadata.exists())}")
        assert metadata.exists(), "the new claim's metadata file went with the old claim"
        assert json.loads(metadata.read_text())["metadata"]["uid"] == new.uid


# ----------------------------------------------------------------------------- row 4


async def test_names_with_dot_dot_never_reach_outside_the_drivers_directories() -> None:
    """A request, claim or namespace name carrying ``../`` is a per-claim error before any file is
    named after it; an unprepare so named removes nothing outside (today: prepare wrote
    metadata.json outside the plugin directory; unprepare removed a directory outside it)."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(4)), driver=DRIVER) as node:
        root = node.kubelet.directory.parent
        plugin_dir = node.options.resolved_plugin_dir
        await prepare_one(node, "x", "w0")
        victim = plugin_dir.parent / "victim"
        victim.mkdir()
        (victim / "keep").write_text("mine")
        before = files_under(root)

        refused: dict[str, str] = {}
        for claim, request, device in (
            ("r", "../../../../escaped", "w1"),
            ("y/../../../../escaped2", "widgets", "w2"),
        ):
            pod = node.pod(claim)
            node.claim(claim, {request: [device]}, pods=[pod])
            try:
                await node.prepare(pod)
            except PodPreparationError as exc:
                refused[claim] = str(exc)
        async with client(node.options) as dra:
            errors = await dra.unprepare(
                [
                    ClaimRef("default", "0000-unknown", "x/../../../victim"),
                    ClaimRef("../..", "0000-unknown2", "victim"),
                ],
                timeout=5,
            )
        assert set(errors) == {"0000-unknown", "0000-unknown2"}

        allowed = (plugin_dir, node.options.cdi_dir)
        outside = sorted(
            str(p.relative_to(root))
            for p in files_under(root) ^ before
            if not any(p.is_relative_to(d) for d in allowed)
        )
        print(
            f"figures: row 4: paths written or removed outside the driver's directories: {outside}"
        )
        print(f"figures: row 4: refused: {refused}")
        assert outside == []
        assert (victim / "keep").read_text() == "mine"
        assert "not a valid request name" in refused["r"]
        assert "not a valid claim name" in refused["y/../../../../escaped2"]


# ----------------------------------------------------------------------------- row 3


async def test_after_a_reboot_every_repeated_prepare_answers_ids_that_resolve() -> None:
    """/var/run/cdi is tmpfs: a reboot empties it and the checkpoint survives. Every CDI ID the
    kubelet's repeated prepares get must name a spec that exists (today: 4 specs before, 0
    after, 0 of 4 IDs resolve)."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(4)), driver=DRIVER) as node:
        cdi_dir = node.options.cdi_dir
        for i in range(4):
            await prepare_one(node, f"c{i}", f"w{i}")
        refs = [
            ClaimRef("default", node.api.claims[("default", f"c{i}")].uid, f"c{i}")
            for i in range(4)
        ]
        specs = sorted(cdi_dir.glob(f"k8s.{DRIVER}-claim_*.json"))
        assert len(specs) == 4
        async with node.stopped(StaticPlugin(RESOURCE, widgets(4))):
            for spec in specs:
                spec.unlink()  # the reboot
        after_start = len(list(cdi_dir.glob(f"k8s.{DRIVER}-claim_*.json")))
        async with client(node.options) as dra:
            results: dict[str, PreparedClaim] = await dra.prepare(refs, timeout=5)
        ids = [i for r in results.values() for d in r.devices for i in d.cdi_ids]
        assert not [r.error for r in results.values() if r.error]
        resolving = sum(resolves(cdi_dir, i) for i in ids)
        size = (node.options.resolved_plugin_dir / "checkpoint.json").stat().st_size
        print(
            f"figures: row 3: specs before 4, after the start {after_start}; "
            f"IDs that resolve: {resolving} of {len(ids)}; checkpoint {size} B for 4 claims"
        )
        assert len(ids) == 4
        assert resolving == 4
        assert after_start == 4

        # Gone while the driver runs (a metadata file too): the repeated prepare writes them.
        mounts = node.spec(refs[0].uid).devices[0]["containerEdits"]["mounts"]
        (metadata,) = [Path(m["hostPath"]) for m in mounts if m["hostPath"].endswith(".json")]
        node.spec_path(refs[0].uid).unlink()
        metadata.unlink()
        async with client(node.options) as dra:
            again = await dra.prepare(refs[:1], timeout=5)
        assert all(resolves(cdi_dir, i) for d in again[refs[0].uid].devices for i in d.cdi_ids)
        assert json.loads(metadata.read_text())["metadata"]["uid"] == refs[0].uid


# ----------------------------------------------------------------------------- row 6


async def test_after_a_damaged_checkpoint_a_recovered_claims_device_is_not_given_again() -> None:
    """The checkpoint is damaged at start: the kept claims know their devices, and a new claim for
    a device one of them holds is refused, naming the device and the holder (today: prepared)."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        await prepare_one(node, "held", "w0")
        checkpoint = node.options.resolved_plugin_dir / "checkpoint.json"
        async with node.stopped(StaticPlugin(RESOURCE, widgets(2))):
            data = checkpoint.read_bytes()
            checkpoint.write_bytes(data[: len(data) // 2])
        assert node.status.recovered_claims == 1
        pod = node.pod("second")
        node.claim("second", {"widgets": ["w0"]}, pods=[pod], check=False)  # a scheduler bug
        with pytest.raises(PodPreparationError, match=r"w0 is already prepared .*default/held"):
            await node.prepare(pod)
        # The device the recovered claim does not hold is given.
        await prepare_one(node, "third", "w1")
        # The recovered claim itself is prepared again (the kubelet's repeated prepare).
        held = node.api.claims[("default", "held")]
        async with client(node.options) as dra:
            again = await dra.prepare([ClaimRef("default", held.uid, "held")], timeout=5)
        assert not again[held.uid].error
        assert [d.device for d in again[held.uid].devices] == ["w0"]
        assert node.status.recovered_claims == 0


async def test_the_former_metadata_layout_goes_with_its_claim() -> None:
    """Directories of the former layout (``<namespace>_<claim>``, of earlier versions): one whose files
    name no prepared claim is removed at start; one whose claim is prepared stays (its spec
    mounts it) until that claim is unprepared."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        pod = await prepare_one(node, "old", "w0")
        uid = node.api.claims[("default", "old")].uid
        root = node.options.resolved_plugin_dir / "dra-device-metadata"
        async with node.stopped(StaticPlugin(RESOURCE, widgets(2))):
            (root / uid).rename(root / "default_old")  # as the former version wrote it
            orphan = root / "default_gone" / "devices"
            orphan.mkdir(parents=True)
            (orphan / "metadata.json").write_text(json.dumps({"metadata": {"uid": "0000-gone"}}))
        assert not (root / "default_gone").exists()
        assert (root / "default_old" / "widgets" / "metadata.json").exists()
        await node.unprepare(pod)
        assert not (root / "default_old").exists()
        assert not (root / uid).exists()


@pytest.mark.parametrize(
    ("names", "ok"),
    [
        (("a", "b"), True),
        (("0000-uid", "gpus", "metadata.json"), True),
        (("..",), False),
        (("a", ".."), False),
        (("a/../..",), False),
        (("",), False),
        ((".",), False),
        (("a\0b",), False),
        (("/etc",), False),
    ],
)
def test_a_name_from_outside_becomes_a_path_only_inside_its_directory(
    tmp_path: Path, names: tuple[str, ...], ok: bool
) -> None:
    from devplugin_sdk._files import inside

    if ok:
        assert inside(tmp_path, *names).is_relative_to(tmp_path)
    else:
        with pytest.raises(ValueError, match="inside"):
            inside(tmp_path, *names)
