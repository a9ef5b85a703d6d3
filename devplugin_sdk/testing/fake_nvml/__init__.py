"""A fake NVML: pynvml's functions, constants and errors over a modelled machine (no GPU needed).

A ``FakeNVML`` instance stands in for the ``pynvml`` module (nvidia-ml-py): the functions a
device plugin needs, with the same names and signatures (the SDK's tests compare them with
``inspect.signature`` of the real module), the same constants, the same ``NVMLError``
subclasses, and NVML's count of ``nvmlInit``/``nvmlShutdown`` pairs. Ready-made machines:
``dgx_a100`` (and ``dgx_a100_40gb``), ``hgx_h100``, ``t4_pcie`` and ``a100_mig``
(deterministic: the same UUIDs in every process); faults: ``xid``, ``ecc_double_bit``,
``lose``/``recover``, the memory faults ``ecc_uncorrected`` (counters that keep rising until
``clear``), ``remap_rows`` and ``retire_pages`` (pending until ``reset``), and ``fail`` (any
function, any NVML error).
``write_host`` writes the matching sysfs, /dev and /proc trees, and ``installed()`` makes
``import pynvml`` give the fake. Behaviour follows nvml.h and nvidia-ml-py's ``pynvml.py``; the
mig-minors layout follows the driver's ``/proc/driver/nvidia-caps/mig-minors`` as read by
nvidia-container-toolkit (``internal/nvcaps``) and Slurm (``gpu_nvml.c``).

Example::

    from devplugin_sdk.backends.nvidia import NvmlPlugin
    from devplugin_sdk.testing import fake_nvml

    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path)  # the machine's sysfs, /dev and /proc trees
    with nvml.installed():  # `import pynvml` gives the fake: the plugin is built on it
        [plugin] = NvmlPlugin.from_config(roots.config())
    nvml.xid(3, 79)  # GPU 3 fell off the bus: delivered through nvmlEventSetWait
    nvml.lose(3)  # ... and every call on it now raises NVMLError_GpuIsLost

Whole programs run on a fake machine too: ``python -m devplugin_sdk.testing.fake_nvml --machine
dgx_a100 --host-root DIR -- run plugin:MyGpuPlugin --config FILE`` writes the host trees under
DIR, installs the fake as ``pynvml`` and runs ``devplugin`` with the arguments after ``--``
(the config file points ``sysfsRoot``, ``devRoot`` and ``procRoot`` at ``DIR/sys``, ``DIR/dev``
and ``DIR/proc``). That is how the NVIDIA example's end-to-end tests run it, and how to try a
GPU plugin on a laptop.
"""

from __future__ import annotations

# pynvml's constants and error classes are attributes of the module, as on pynvml.
from devplugin_sdk.testing.fake_nvml._constants import *  # noqa: F403
from devplugin_sdk.testing.fake_nvml._errors import *  # noqa: F403
from devplugin_sdk.testing.fake_nvml._errors import NVMLError
from devplugin_sdk.testing.fake_nvml._fake import FakeNVML
from devplugin_sdk.testing.fake_nvml._machines import (
    MACHINES,
    a100_mig,
    dgx_a100,
    dgx_a100_40gb,
    hgx_h100,
    t4_pcie,
)
from devplugin_sdk.testing.fake_nvml._model import FakeGPU, FakeMIG, HostRoots
from devplugin_sdk.testing.fake_nvml._model import mig_minors as mig_minors
from devplugin_sdk.testing.fake_nvml._runner import main

__all__ = [
    "MACHINES",
    "FakeGPU",
    "FakeMIG",
    "FakeNVML",
    "HostRoots",
    "NVMLError",
    "a100_mig",
    "dgx_a100",
    "dgx_a100_40gb",
    "hgx_h100",
    "main",
    "t4_pcie",
]
