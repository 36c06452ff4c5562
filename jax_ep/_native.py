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
import hashlib
import importlib
import os
import threading
import warnings

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


# The files the extension is built from, as ffi/source_hash.cmake hashes them.
_HASHED_SUFFIXES = (".cu", ".cuh", ".h", ".cc", ".map", ".cmake")


def source_hash_of_checkout(root: str | None = None) -> str | None:
    """The extension's source hash of the checkout at ``root`` (default: the one this package
    is imported from), computed as the build computes it (ffi/source_hash.cmake); None where
    there are no sources (an installed wheel)."""
    if root is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ffi = os.path.join(root, "ffi")
    if not (os.path.isdir(ffi) and os.path.isfile(os.path.join(root, "CMakeLists.txt"))):
        return None
    files = ["CMakeLists.txt"]
    for folder, _, names in os.walk(ffi):
        files += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/")
                  for n in names if n.endswith(_HASHED_SUFFIXES)]
    lines = []
    for f in sorted(files):
        with open(os.path.join(root, f), "rb") as fh:
            lines.append(f"{f}:{hashlib.sha256(fh.read()).hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _built_hash(module) -> str | None:
    return getattr(module, "source_hash", lambda: None)()  # None: built before it was recorded


def provenance(module) -> str:
    """Where the loaded extension comes from and whether it was built from this checkout."""
    built = _built_hash(module)
    here = source_hash_of_checkout()
    if built is None:
        state = "built before extensions reported their sources"
    elif here is None:
        state = f"sources {built[:12]}"
    elif built == here:
        state = f"sources {built[:12]}, this checkout's"
    else:
        state = (f"sources {built[:12]}, NOT this checkout's ({here[:12]}): a stale or foreign "
                 "build")
    return f"jax_ep._C at {module.__file__} ({state})"


@functools.cache
def _load():
    _preload_nvshmem_host()
    try:
        module = importlib.import_module("jax_ep._C")
    except ImportError as e:
        why = (f"the CUDA extension jax_ep._C is not available ({e}); it is built at install "
               "time when nvcc, jaxlib and nvidia-nvshmem-cu12/13 are present")
        if "undefined symbol" in str(e):
            why += ("; an undefined symbol means it was built against another NVSHMEM than the "
                    "one installed: rebuild it against this one (README, GPU path)")
        return None, why
    here = source_hash_of_checkout()
    if here is not None and _built_hash(module) != here:
        # A run of another build than the sources beside it measures and tests that build.
        warnings.warn(f"{provenance(module)}; rebuild it from this checkout (README) unless "
                      "that build is the one meant", stacklevel=2)
    return module, ""


def load():
    """``(module, "")``, or ``(None, reason)`` when the extension cannot be imported."""
    return _load()


def build_line() -> str:
    """One line for logs: the extension this process runs (provenance), or why there is none."""
    module, why = load()
    return provenance(module) if module is not None else f"jax_ep._C: {why[:120]}"


def gpu_present() -> bool:
    """Whether JAX's default backend is a GPU."""
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


_register_lock = threading.Lock()
_registered = False


# Targets XLA records into its command buffers (CUDA graphs) by default: each launches one
# kernel that reads only its operands and writes only its results, with no peer, no state kept
# across calls and no host synchronization, so where it runs in the graph only its operands
# decide. A chain of layouts launched one by one is bound by the host (a launch and XLA's thunk,
# ~8 µs a call against a 4 µs kernel); recorded, the GPU runs them back to back.
LOCAL_TARGETS = frozenset({"jax_ep_layout", "jax_ep_quantize_fp8", "jax_ep_grouped_matmul"})


def command_buffer_traits(name: str) -> dict:
    """register_ffi_target's keyword arguments for target `name`: command-buffer compatible
    for LOCAL_TARGETS, and for every target under ``JAX_EP_COMMAND_BUFFERS=1`` (the others'
    kernels wait for peers or keep call numbers on the device; XLA may run independent
    commands of a graph side by side, which the order across ranks does not allow)."""
    if name not in LOCAL_TARGETS and not config.command_buffers():
        return {}
    from jax._src.lib import xla_client

    return {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}


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
        for name, capsule in module.ffi_targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA",
                                        **command_buffer_traits(name))
        _registered = True
        return True
