"""Keep an installed libtpu quiet on machines without a TPU (`import csa_jax` calls this).

The cause: with JAX_PLATFORMS unset, jax initialises every backend it knows on first use, and
an installed libtpu (the `tpu-aot` extra, for compiling pallas_tpu ahead of time on a CPU)
registers the "tpu" one. On a machine without a TPU, libtpu's start-up then looks for its
topology (`TPU_ACCELERATOR_TYPE`, `TPU_WORKER_HOSTNAMES`: unset off a Cloud TPU VM), writes
five lines to stderr ("Failed to find host bounds for accelerator type ...", "E0000 ...
INVALID_ARGUMENT: Error: unexpected worker hostname ...", a `libtpu_init_utils.cc` trace) and
fails; jax drops the failure quietly and goes on with the CPU. The lines do not appear with
JAX_PLATFORMS=cpu, nor while another process holds libtpu's machine-wide lock
(/tmp/libtpu_lockfile: then libtpu gives up before it looks).

`skip_absent_tpu()` therefore sets `jax_platforms` to "cpu" when all of these hold: the user
chose no platforms (JAX_PLATFORMS is not in the environment, even as '', and jax's
`jax_platforms` option is unset), libtpu is installed, and the machine shows no accelerator (no
TPU: no Google TPU PCI device, /dev/accel*, /dev/vfio/<n> or TPU_* topology variable; no GPU:
no /dev/nvidia0, /dev/nvidiactl, /dev/dxg or /dev/kfd). Nothing else would run there, so the
platform jax picks is the same; only the failed TPU probe is skipped. jax's ahead-of-time TPU
compiler (`jax.experimental.topologies`, csa_jax/kernels/tpu/aot.py) loads libtpu itself and is
not affected. On GPU machines nothing changes (libtpu's lines may appear there: set
JAX_PLATFORMS=cuda,cpu to skip its probe).
"""
from __future__ import annotations

import glob
import importlib.util
import os

__all__ = ["accelerator_present", "skip_absent_tpu"]

_GOOGLE_PCI_VENDOR = "0x1ae0"
_GPU_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_NAME",
            "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS", "JAX_FORCE_TPU_INIT")


def _google_pci_device() -> bool:
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def accelerator_present() -> str | None:
    """What suggests a TPU or GPU on this machine (a device node, a PCI device, a TPU_*
    variable), or None when nothing does."""
    for name in _TPU_ENV:
        if os.environ.get(name):
            return f"${name}"
    nodes = glob.glob("/dev/accel*") + [p for p in glob.glob("/dev/vfio/*")
                                        if os.path.basename(p).isdigit()]
    nodes += [p for p in _GPU_NODES if os.path.exists(p)]
    if nodes:
        return nodes[0]
    if _google_pci_device():
        return f"a PCI device of vendor {_GOOGLE_PCI_VENDOR} (Google)"
    return None


def skip_absent_tpu() -> bool:
    """Set jax_platforms to "cpu" when libtpu is installed, the user chose no platforms and
    the machine has no accelerator (see the module docstring). True if it did."""
    if "JAX_PLATFORMS" in os.environ:
        return False
    import jax

    if jax.config.jax_platforms is not None:
        return False
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        return False
    if accelerator_present() is not None:
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
