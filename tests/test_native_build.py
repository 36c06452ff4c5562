"""The CUDA extension, when built: exports nothing but its entry point, and has every target."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from jax_ep import _native

module, why = _native.load()
needs_module = pytest.mark.skipif(module is None, reason=f"extension not built: {why}")


@needs_module
def test_module_exports_only_its_entry_point():
    # Exported libstdc++ template instances once made NVSHMEM's host library bind to them and
    # crash during initialisation: the module must export PyInit__C alone.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", module.__file__], capture_output=True,
                         text=True, check=True).stdout
    exported = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert exported == ["PyInit__C"], exported


@needs_module
def test_ffi_targets_are_capsules():
    targets = module.ffi_targets()
    assert "jax_ep_layout" in targets
    assert all(type(c).__name__ == "PyCapsule" for c in targets.values())
    assert module.unique_id_size() > 0
    assert not module.is_initialized()


def test_missing_extension_is_reported_clearly():
    if module is not None:
        pytest.skip("the extension is built")
    assert "jax_ep._C" in why
