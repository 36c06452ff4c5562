"""Loading the CUDA extension ``jax_ep._C`` and registering its FFI targets with XLA.

The extension exists when the package was built with a CUDA compiler (see CMakeLists.txt). It
links NVSHMEM's host library from the ``nvidia-nvshmem-cu12/13`` wheel; that library is loaded
here first, from wherever the wheel is installed, so that the extension finds it even when the
two live in different site-packages (e.g. a venv with ``--system-site-packages``).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import os
import threading

import jax

from jax_ep import config

# NVSHMEM reads these at initialisation. Multicast (NVLS) stays off whatever the user set: it
# can take a shared host's GPUs out of service.
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _preload_nvshmem_host() -> None:
    try:
        import nvidia.nvshmem as wheel
    except ImportError:
        return  # not a wheel install: the extension's RPATH or LD_LIBRARY_PATH must find it
    for folder in wheel.__path__:
        for path in sorted(glob.glob(os.path.join(folder, "lib", "libnvshmem_host.so.*"))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


@functools.cache
def _load():
    _preload_nvshmem_host()
    try:
        return importlib.import_module("jax_ep._C"), ""
    except ImportError as e:
        why = (f"the CUDA extension jax_ep._C is not available ({e}); it is built at install "
               "time when nvcc, jaxlib and nvidia-nvshmem-cu12/13 are present")
        if "undefined symbol" in str(e):
            why += ("; an undefined symbol means it was built against another NVSHMEM than the "
                    "one installed: rebuild it against this one (README, GPU path)")
        return None, why


def load():
    """``(module, "")``, or ``(None, reason)`` when the extension cannot be imported."""
    return _load()


def gpu_present() -> bool:
    """Whether JAX's default backend is a GPU."""
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


_register_lock = threading.Lock()
_registered = False


def register(force: bool = False) -> bool:
    """Register every FFI target of the extension for the CUDA platform, once per process.

    Does nothing (returns False) when JAX has no GPU backend, unless ``force``. Raises
    RuntimeError when the extension is missing.
    """
    global _registered
    with _register_lock:
        if _registered:
            return True
        if not force and not gpu_present():
            return False
        module, why = load()
        if module is None:
            raise RuntimeError(why)
        extra = {}
        if config.command_buffers():
            # The handlers only launch kernels whose arguments depend on buffer addresses and
            # attributes (call numbers live on the device), so XLA may record them into CUDA
            # graphs. Opt-in until measured: XLA may then run independent calls concurrently.
            from jax._src.lib import xla_client

            extra["traits"] = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
        for name, capsule in module.ffi_targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA", **extra)
        _registered = True
        return True
