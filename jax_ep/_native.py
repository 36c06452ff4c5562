"""Loading the CUDA extension ``jax_ep._C`` and registering its FFI targets with XLA."""

from __future__ import annotations

import functools
import importlib

import jax


@functools.cache
def _load():
    try:
        return importlib.import_module("jax_ep._C"), ""
    except ImportError as e:
        return None, (f"the CUDA extension jax_ep._C is not available ({e}); it is built when "
                      "a CUDA compiler is found at install time")


def load():
    """(module or None, reason it is missing)."""
    return _load()


def gpu_present() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


_registered = False


def register() -> None:
    """Register every handler of the extension for the CUDA platform, once."""
    global _registered
    if _registered:
        return
    module, why = load()
    if module is None:
        raise RuntimeError(why)
    for name, capsule in module.ffi_targets().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _registered = True
