"""The public fake NVML against the real pynvml (nvidia-ml-py), and its machines and faults."""

from __future__ import annotations

import ast
import ctypes
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pynvml
import pytest

from devplugin_sdk.testing import fake_nvml
from devplugin_sdk.testing.fake_nvml import FakeNVML

FUNCTIONS = sorted(
    name for name in dir(FakeNVML) if name.startswith("nvml") and callable(getattr(FakeNVML, name))
)
CONSTANTS = sorted(name for name in vars(fake_nvml) if name.startswith(("NVML_", "nvmlEventType")))
ERRORS = sorted(name for name in vars(fake_nvml) if name.startswith("NVMLError_"))


def shape(function: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_fake_function_has_the_signature_of_the_real_one(name: str) -> None:
    assert hasattr(pynvml, name), f"pynvml has no {name}"

    # Bound methods drop self, so the parameters line up with pynvml's functions.
    assert shape(getattr(FakeNVML([]), name)) == shape(getattr(pynvml, name))


def test_the_backend_uses_only_names_the_installed_pynvml_has() -> None:
    """Every pynvml function, constant and error class the NVIDIA backend reaches by attribute
    exists in the installed nvidia-ml-py: the newest in the main run, the declared minimum
    (pyproject's `nvidia` extra) in the floor run. Optional ones go through getattr with a default."""
    import devplugin_sdk.backends.nvidia as backend

    sources = sorted(Path(backend.__file__).parent.glob("*.py"))  # the package's modules
    used = {
        node.attr
        for source in sources
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Attribute)
        and re.fullmatch(r"nvml[A-Z]\w*|NVML_\w+|NVMLError_\w+", node.attr)
    }
    assert len(used) > 20  # the backend's queries, events and errors
    assert sorted(name for name in used if not hasattr(pynvml, name)) == []


@pytest.mark.parametrize("name", CONSTANTS)
def test_every_fake_constant_has_the_real_value(name: str) -> None:
    assert getattr(fake_nvml, name) == getattr(pynvml, name)
    assert getattr(FakeNVML([]), name) == getattr(pynvml, name)


def test_the_p2p_read_index_is_the_tuple_pynvml_really_defines() -> None:
    assert pynvml.NVML_P2P_CAPS_INDEX_READ == (0,)
    nvml = fake_nvml.dgx_a100()
    nvml.nvmlInit()
    a, b = (nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))

    with pytest.raises(ctypes.ArgumentError):
        nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_READ)
    assert nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == 0


def test_the_fake_has_every_error_class_pynvml_has() -> None:
    real = sorted(name for name in dir(pynvml) if name.startswith("NVMLError_"))

    assert real == ERRORS


@pytest.mark.parametrize("name", ERRORS)
def test_error_classes_map_codes_and_messages_like_pynvml(name: str) -> None:
    fake_class = getattr(fake_nvml, name)
    real_class = getattr(pynvml, name)
    fake, real = fake_class(), real_class()

    assert fake.value == real.value
    assert type(fake_nvml.NVMLError(real.value)) is fake_class
    assert isinstance(fake_nvml.NVMLError(real.value), fake_nvml.NVMLError)
    if real.value in pynvml.NVMLError._errcode_to_string:  # the others need the C library
        assert str(fake) == str(real)


def test_gpu_is_lost_and_timeout_are_the_codes_the_backend_relies_on() -> None:
    assert pynvml.NVML_ERROR_GPU_IS_LOST == fake_nvml.NVML_ERROR_GPU_IS_LOST == 15
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)) is pynvml.NVMLError_Timeout


def test_real_event_wait_raises_timeout_when_nvml_answers_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stand in for the C function only: pynvml's own wrapper turns the code into the error.
    monkeypatch.setattr(
        pynvml, "_nvmlGetFunctionPointer", lambda name: lambda *args: pynvml.NVML_ERROR_TIMEOUT
    )

    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(None, 1)


def test_fake_event_wait_raises_timeout_when_nothing_arrives() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.nvmlInit()
    event_set = nvml.nvmlEventSetCreate()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)

    with pytest.raises(nvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(event_set, 1)

    nvml.xid(0, 79)
    event = nvml.nvmlEventSetWait_v2(event_set, 1)
    assert (event.device, event.eventType, event.eventData) == (handle, 8, 79)
    assert (event.gpuInstanceId, event.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)


def test_events_reach_only_sets_registered_for_that_gpu_and_type() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.nvmlInit()
    event_set = nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(
        nvml.nvmlDeviceGetHandleByIndex(1), nvml.nvmlEventTypeDoubleBitEccError, event_set
    )

    nvml.xid(1, 79)  # Xid events were not asked for
    nvml.xid(0, 79)
    nvml.ecc_double_bit(1)

    assert nvml.nvmlEventSetWait(event_set, 1).eventType == nvml.nvmlEventTypeDoubleBitEccError
    with pytest.raises(nvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait(event_set, 1)


def test_registering_an_unsupported_event_type_is_refused() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.gpus[0].supported_events = nvml.nvmlEventTypeXidCriticalError
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)

    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceRegisterEvents(
            handle, nvml.nvmlEventTypeDoubleBitEccError, nvml.nvmlEventSetCreate()
        )


def test_calls_before_nvml_init_raise_uninitialized() -> None:
    nvml = fake_nvml.t4_pcie()

    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 4
    nvml.nvmlShutdown()
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_a_lost_gpu_answers_gpu_is_lost_until_recovered() -> None:
    nvml = fake_nvml.dgx_a100()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    nvml.lose(3)

    for call in (
        lambda: nvml.nvmlDeviceGetUUID(handle),
        lambda: nvml.nvmlDeviceGetMemoryInfo(handle),
        lambda: nvml.nvmlDeviceGetHandleByIndex(3),
        lambda: nvml.nvmlDeviceGetHandleByUUID(nvml.gpus[3].uuid),
    ):
        with pytest.raises(nvml.NVMLError_GpuIsLost, match="GPU is lost"):
            call()
    assert nvml.nvmlDeviceGetCount() == 8
    nvml.recover(3)
    assert nvml.nvmlDeviceGetUUID(handle) == nvml.gpus[3].uuid


UNCORRECTED_VOLATILE = (fake_nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fake_nvml.NVML_VOLATILE_ECC)
UNCORRECTED_AGGREGATE = (fake_nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fake_nvml.NVML_AGGREGATE_ECC)


def test_real_memory_health_getters_return_what_the_fake_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pynvml's own wrappers around stand-in C functions: the shapes and errors the fake mirrors."""

    def c_function(name: str) -> Any:
        def remapped_rows(device: Any, corr: Any, unc: Any, pending: Any, failure: Any) -> int:
            for ref, value in ((corr, 3), (unc, 2), (pending, 1), (failure, 0)):
                ctypes.cast(ref, ctypes.POINTER(ctypes.c_uint)).contents.value = value
            return pynvml.NVML_SUCCESS

        def pending_status(device: Any, pending: Any) -> int:
            ctypes.cast(pending, ctypes.POINTER(ctypes.c_int)).contents.value = 1
            return pynvml.NVML_SUCCESS

        def total_ecc(device: Any, error_type: Any, counter_type: Any, count: Any) -> int:
            return pynvml.NVML_ERROR_NOT_SUPPORTED  # a board without ECC

        return {
            "nvmlDeviceGetRemappedRows": remapped_rows,
            "nvmlDeviceGetRetiredPagesPendingStatus": pending_status,
            "nvmlDeviceGetTotalEccErrors": total_ecc,
        }[name]

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", c_function)
    nvml = fake_nvml.dgx_a100()
    nvml.nvmlInit()
    nvml.remap_rows(0, 2)
    fake_a100 = nvml.nvmlDeviceGetHandleByIndex(0)
    t4 = fake_nvml.t4_pcie()
    t4.nvmlInit()
    t4.retire_pages(0)
    t4.gpus[1].ecc = False

    assert pynvml.nvmlDeviceGetRemappedRows(None) == (3, 2, 1, 0)
    assert nvml.nvmlDeviceGetRemappedRows(fake_a100) == (0, 2, 1, 0)
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(None) == pynvml.NVML_FEATURE_ENABLED
    assert t4.nvmlDeviceGetRetiredPagesPendingStatus(t4.nvmlDeviceGetHandleByIndex(0)) == 1
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTotalEccErrors(None, *UNCORRECTED_VOLATILE)
    with pytest.raises(t4.NVMLError_NotSupported):
        t4.nvmlDeviceGetTotalEccErrors(t4.nvmlDeviceGetHandleByIndex(1), *UNCORRECTED_VOLATILE)


def test_uncorrected_ecc_counters_keep_rising_at_every_read_until_cleared() -> None:
    nvml = fake_nvml.dgx_a100()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(3)

    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *UNCORRECTED_VOLATILE) == 0
    nvml.ecc_uncorrected(3, 2)
    reads = [nvml.nvmlDeviceGetTotalEccErrors(handle, *UNCORRECTED_VOLATILE) for _ in range(3)]
    nvml.clear(3)
    after = [nvml.nvmlDeviceGetTotalEccErrors(handle, *UNCORRECTED_VOLATILE) for _ in range(2)]

    assert reads == [4, 6, 8]
    assert after == [8, 8]
    # Every read of an uncorrected counter adds to both; corrected errors are another count.
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *UNCORRECTED_AGGREGATE) == 8
    corrected = (fake_nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, fake_nvml.NVML_VOLATILE_ECC)
    assert nvml.nvmlDeviceGetTotalEccErrors(handle, *corrected) == 0
    with pytest.raises(nvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetTotalEccErrors(handle, 2, fake_nvml.NVML_VOLATILE_ECC)


def test_a_one_off_ecc_fault_does_not_rise() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)

    nvml.ecc_uncorrected(0, 5, rising=False)

    assert [nvml.nvmlDeviceGetTotalEccErrors(handle, *UNCORRECTED_VOLATILE) for _ in "ab"] == [5, 5]
    with pytest.raises(ValueError, match="count must be >= 1"):
        nvml.ecc_uncorrected(0, 0)


def test_a_reset_ends_pending_remaps_and_retirements_and_zeroes_volatile_counts() -> None:
    a100, t4 = fake_nvml.dgx_a100(), fake_nvml.t4_pcie()
    a100.nvmlInit()
    t4.nvmlInit()
    gpu, old = a100.nvmlDeviceGetHandleByIndex(1), t4.nvmlDeviceGetHandleByIndex(2)
    a100.ecc_uncorrected(1, 4)
    a100.remap_rows(1, 3)
    a100.remap_rows(1, 1, failed=True)
    a100.lose(1)
    t4.retire_pages(2)

    a100.reset(1)
    t4.reset(2)

    assert a100.nvmlDeviceGetRemappedRows(gpu) == (0, 4, 0, 1)  # a failure stays recorded
    assert a100.nvmlDeviceGetTotalEccErrors(gpu, *UNCORRECTED_VOLATILE) == 0
    assert a100.nvmlDeviceGetTotalEccErrors(gpu, *UNCORRECTED_AGGREGATE) == 4
    assert t4.nvmlDeviceGetRetiredPagesPendingStatus(old) == fake_nvml.NVML_FEATURE_DISABLED


def test_memory_health_queries_answer_not_supported_where_nvml_does() -> None:
    t4, a100 = fake_nvml.t4_pcie(), fake_nvml.dgx_a100()
    mig = fake_nvml.a100_mig([("1g.10gb",), None])
    for nvml in (t4, a100, mig):
        nvml.nvmlInit()
    t4.gpus[3].ecc = False  # ECC switched off
    mig_device = mig.nvmlDeviceGetHandleByUUID(mig.gpus[0].migs[0].uuid)
    unsupported = [
        lambda: t4.nvmlDeviceGetRemappedRows(t4.nvmlDeviceGetHandleByIndex(0)),  # Turing
        lambda: a100.nvmlDeviceGetRetiredPagesPendingStatus(a100.nvmlDeviceGetHandleByIndex(0)),
        lambda: t4.nvmlDeviceGetTotalEccErrors(t4.nvmlDeviceGetHandleByIndex(3), 1, 0),
        # nvml.h: no remapped rows on a MIG-enabled GPU with instances, none per MIG device.
        lambda: mig.nvmlDeviceGetRemappedRows(mig.nvmlDeviceGetHandleByIndex(0)),
        lambda: mig.nvmlDeviceGetTotalEccErrors(mig_device, 1, 0),
    ]

    for call in unsupported:
        with pytest.raises(fake_nvml.NVMLError_NotSupported):
            call()
    assert mig.nvmlDeviceGetRemappedRows(mig.nvmlDeviceGetHandleByIndex(1)) == (0, 0, 0, 0)
    lost = a100.nvmlDeviceGetHandleByIndex(0)
    a100.lose(0)
    with pytest.raises(fake_nvml.NVMLError_GpuIsLost):
        a100.nvmlDeviceGetTotalEccErrors(lost, 1, 0)


def test_fail_injects_an_error_for_the_next_calls_only() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.fail("nvmlInit", fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED, times=2)

    for _ in range(2):
        with pytest.raises(nvml.NVMLError_DriverNotLoaded):
            nvml.nvmlInit()
    nvml.nvmlInit()
    nvml.fail("nvmlDeviceGetCount", fake_nvml.NVML_ERROR_UNKNOWN, times=None)
    for _ in range(3):
        with pytest.raises(nvml.NVMLError_Unknown):
            nvml.nvmlDeviceGetCount()
    nvml.clear_failures()
    assert nvml.nvmlDeviceGetCount() == 4
    assert nvml.calls["nvmlDeviceGetCount"] == 4
    with pytest.raises(AttributeError, match="no NVML function"):
        nvml.fail("nvmlNoSuchThing", 1)


def test_the_machines_look_like_the_real_ones() -> None:
    models = {
        "dgx_a100": (fake_nvml.dgx_a100(), 8, "NVIDIA A100-SXM4-80GB", 12),
        "hgx_h100": (fake_nvml.hgx_h100(), 8, "NVIDIA H100 80GB HBM3", 18),
        "t4_pcie": (fake_nvml.t4_pcie(), 4, "Tesla T4", 0),
    }
    for nvml, count, name, links in models.values():
        nvml.nvmlInit()
        assert nvml.nvmlDeviceGetCount() == count
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetName(handle) == name
        assert nvml.nvmlDeviceGetUUID(handle).startswith("GPU-")
        assert len(nvml.gpus[0].nvlinks) == links
        assert len({g.uuid for g in nvml.gpus}) == count


def test_t4_has_no_nvlink_and_no_mig() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)

    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(handle, 0)
    with pytest.raises(nvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetMigMode(handle)
    other = nvml.nvmlDeviceGetHandleByIndex(1)
    far = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetTopologyCommonAncestor(handle, other) == nvml.NVML_TOPOLOGY_SINGLE
    assert nvml.nvmlDeviceGetTopologyCommonAncestor(handle, far) == nvml.NVML_TOPOLOGY_SYSTEM


def test_mig_devices_are_found_slot_by_slot_with_empty_slots_not_found() -> None:
    nvml = fake_nvml.a100_mig([("3g.40gb", "1c.2g.20gb")])
    nvml.nvmlInit()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)

    assert nvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-80GB MIG 1c.2g.20gb"
    assert nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
    assert nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) is gpu
    attrs = nvml.nvmlDeviceGetAttributes(mig)
    assert (attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount) == (2, 1)
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2)


def test_write_host_writes_numa_nodes_device_nodes_and_mig_minors(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",), None])
    nvml.gpus[1].numa_node = None

    roots = nvml.write_host(tmp_path)

    numa = roots.sysfs_root / "bus/pci/devices/0000:07:00.0/numa_node"
    assert numa.read_text() == "0\n"
    assert (roots.sysfs_root / "bus/pci/devices/0000:0f:00.0/numa_node").read_text() == "-1\n"
    assert sorted(p.name for p in roots.dev_root.iterdir()) == [
        "nvidia-caps",
        "nvidia-modeset",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia0",
        "nvidia1",
        "nvidiactl",
    ]
    minors = (roots.proc_root / "driver/nvidia-caps/mig-minors").read_text().splitlines()
    assert minors[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert "gpu1/gi14/ci7/access 272" in minors
    # Nodes exist for the one instance there is (gi 1, ci 0).
    assert sorted(p.name for p in (roots.dev_root / "nvidia-caps").iterdir()) == [
        "nvidia-cap12",
        "nvidia-cap13",
    ]


def test_nvml_counts_inits_and_shutdowns_like_the_real_library() -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.nvmlInit()
    nvml.nvmlInit()  # a second user in the same process
    nvml.nvmlShutdown()

    assert nvml.init_count == 1
    assert nvml.nvmlDeviceGetCount() == 4  # still initialised for the other user
    nvml.nvmlShutdown()
    assert nvml.init_count == 0
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlShutdown()  # nothing left to shut down
    assert nvml.init_count == 0


def test_installed_makes_import_pynvml_give_the_fake_and_puts_pynvml_back() -> None:
    nvml = fake_nvml.t4_pcie()

    with nvml.installed():
        import pynvml as inside

    import pynvml as after

    assert inside is nvml
    assert after is pynvml


def test_the_module_docstring_example_runs(tmp_path: Path) -> None:
    doc = fake_nvml.__doc__
    assert doc is not None
    block = doc.split("Example::\n", 1)[1].split("\n\n\n", 1)[0]
    code = textwrap.dedent(block.split("\n\nWhole programs", 1)[0])
    namespace: dict[str, Any] = {"tmp_path": tmp_path}

    exec(compile(code, "fake_nvml example", "exec"), namespace)

    plugin, nvml = namespace["plugin"], namespace["nvml"]
    assert plugin.nvml is nvml
    assert plugin.config.sysfs_root == tmp_path / "sys"
    assert nvml.gpus[3].lost


def test_host_roots_give_the_backend_keys(tmp_path: Path) -> None:
    roots = fake_nvml.t4_pcie().write_host(tmp_path)

    assert roots.config() == {
        "sysfsRoot": str(tmp_path / "sys"),
        "devRoot": str(tmp_path / "dev"),
        "procRoot": str(tmp_path / "proc"),
    }


def test_machines_are_the_same_in_every_process() -> None:
    code = "from devplugin_sdk.testing import fake_nvml as f; print(f.dgx_a100().gpus[7].uuid)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert out.stdout.strip() == fake_nvml.dgx_a100().gpus[7].uuid
    assert set(fake_nvml.MACHINES) == {
        "a100_mig",
        "dgx_a100",
        "dgx_a100_40gb",
        "hgx_h100",
        "t4_pcie",
    }


def test_the_40gb_dgx_is_the_80gb_one_with_half_the_memory_and_its_own_uuids() -> None:
    big, small = fake_nvml.dgx_a100(), fake_nvml.dgx_a100_40gb()

    assert [g.memory_mib for g in small.gpus] == [40960] * 8
    assert small.gpus[0].name == "NVIDIA A100-SXM4-40GB"
    assert [g.numa_node for g in small.gpus] == [g.numa_node for g in big.gpus]
    assert not {g.uuid for g in small.gpus} & {g.uuid for g in big.gpus}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--machine", "t4_pcie"], "give devplugin's arguments after --"),
        (["--machine", "t4_pcie", "--mig", "1g.10gb", "--", "run"], "--mig needs"),
        (["--machine", "a100_mig", "--mig", "9g.1gb", "--", "run"], "unknown A100 80GB"),
        (["--machine", "v100", "--", "run"], "invalid choice"),
    ],
)
def test_the_runner_refuses_a_bad_command_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        fake_nvml.main(argv)

    assert caught.value.code == 2
    assert message in capsys.readouterr().err
