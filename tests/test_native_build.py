"""The CUDA extension, when built: exports only its entry point, has every target, and (on a GPU)
computes the dispatch layout exactly like NumPy.

Without the extension (no nvcc at install time) or without a GPU, the tests say so and skip.
``JAX_PLATFORMS=cuda python -m pytest tests/test_native_build.py`` runs the GPU part on one GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from jax_ep import _native

module, why = _native.load()
needs_module = pytest.mark.skipif(module is None, reason=f"extension not built: {why}")


def _gpu_skip_reason():
    if module is None:
        return f"extension not built: {why}"
    import jax

    try:
        backend = jax.default_backend()
    except RuntimeError as e:
        return f"no JAX backend: {e}"
    if backend != "gpu":
        return f"needs a GPU: JAX's backend is {backend!r} (set JAX_PLATFORMS=cuda on a GPU host)"
    return None


@needs_module
def test_module_exports_only_its_entry_point():
    # Exported libstdc++ template instances once made NVSHMEM's host library bind to them and
    # crash during initialisation: the module must export PyInit__C alone.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", module.__file__], capture_output=True,
                         text=True, check=True).stdout
    exported = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert exported == ["PyInit__C"], exported
    demangled = subprocess.run([nm, "-D", "-C", "--defined-only", module.__file__],
                               capture_output=True, text=True, check=True).stdout
    assert "std::" not in demangled


@needs_module
def test_python_copy_of_the_kernel_limits_matches_the_extension():
    # Tracing checks the limits without loading the extension: its Python copy must agree.
    from jax_ep import _cuda

    assert module.limits() == _cuda.LIMITS


@needs_module
def test_ffi_targets_are_capsules():
    targets = module.ffi_targets()
    assert "jax_ep_layout" in targets
    assert all(name.startswith("jax_ep_") for name in targets)
    assert all(type(c).__name__ == "PyCapsule" for c in targets.values())
    assert module.unique_id_size() > 0
    assert not module.is_initialized()
    assert module.buffer_bytes() == 0


_BEFORE_INITIALIZE = """
from jax_ep import _native
module, why = _native.load()
assert set(module.handler_calls()) == set(module.ffi_targets())
assert all(v == 0 for v in module.handler_calls().values()), module.handler_calls()
assert module.low_latency_calls() == []  # no low-latency buffer
try:
    module.profile_read()
except RuntimeError as e:
    assert "not initialised" in str(e), e
else:
    raise AssertionError("profile_read before initialize returned")
"""


@needs_module
def test_diagnostics_before_initialize():
    # one counter per FFI target, all zero, in a process that has run no handler: a fresh one,
    # since earlier tests of this session (the GPU suite's) may have run handlers here
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_EP_RANK", None)  # not one of the launcher's ranks
    done = subprocess.run([sys.executable, "-c", _BEFORE_INITIALIZE], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_dispatch_paths_are_checked(monkeypatch):
    from jax_ep import config

    shape = dict(num_ranks=2, num_topk=8, num_experts=256, layout="rank_major")
    monkeypatch.delenv("JAX_EP_DISPATCH", raising=False)
    assert config.dispatch_path(None, **shape) == "fused"  # the default
    for path in ("pull", "fused", "copy"):
        monkeypatch.setenv("JAX_EP_DISPATCH", path)
        assert config.dispatch_path(None, **shape) == path
    for path in ("bogus", "push", "bulk"):
        monkeypatch.setenv("JAX_EP_DISPATCH", path)
        with pytest.raises(ValueError, match="JAX_EP_DISPATCH"):
            config.dispatch_path(None, **shape)


def test_missing_extension_is_reported_clearly():
    if module is not None:
        pytest.skip("the extension is built")
    assert "jax_ep._C" in why


def test_extension_built_against_another_nvshmem_is_named(monkeypatch):
    def import_module(name):
        raise ImportError(f"{name}: undefined symbol: nvshmem_selected_device_transport, "
                          "version NVSHMEM")

    monkeypatch.setattr(_native.importlib, "import_module", import_module)
    loaded, reason = _native._load.__wrapped__()  # uncached: the real load is kept
    assert loaded is None
    assert "jax_ep._C" in reason and "built against another NVSHMEM" in reason


def _checkout_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(_native.__file__)))


def test_the_checkout_is_hashed_as_the_build_hashes_it(tmp_path):
    """jax_ep/_native.py and ffi/source_hash.cmake (the build's) give one hash."""
    cmake = shutil.which("cmake")
    root = _checkout_root()
    if cmake is None or _native.source_hash_of_checkout(root) is None:
        pytest.skip("needs cmake and a source checkout")
    out = tmp_path / "hash.h"
    subprocess.run([cmake, f"-DROOT={root}", f"-DOUT={out}", "-P",
                    os.path.join(root, "ffi", "source_hash.cmake")], check=True)
    assert f'"{_native.source_hash_of_checkout(root)}"' in out.read_text()


def test_the_hash_follows_the_extensions_sources_only(tmp_path):
    (tmp_path / "ffi" / "kernels").mkdir(parents=True)
    (tmp_path / "CMakeLists.txt").write_text("project(x)\n")
    kernel = tmp_path / "ffi" / "kernels" / "k.cu"
    kernel.write_text("__global__ void k() {}\n")
    first = _native.source_hash_of_checkout(str(tmp_path))
    (tmp_path / "ffi" / "notes.py").write_text("# not a source of the extension\n")
    assert _native.source_hash_of_checkout(str(tmp_path)) == first
    kernel.write_text("__global__ void k() { }\n")
    assert _native.source_hash_of_checkout(str(tmp_path)) != first
    assert _native.source_hash_of_checkout(str(tmp_path / "ffi")) is None  # not a checkout


def test_a_stale_extension_is_named_when_loaded(monkeypatch):
    if _native.source_hash_of_checkout() is None:
        pytest.skip("an installed package: no sources beside it")
    stale = types.SimpleNamespace(__file__="/somewhere/_C.so", source_hash=lambda: "0" * 64)
    monkeypatch.setattr(_native.importlib, "import_module", lambda name: stale)
    with pytest.warns(UserWarning, match="NOT this checkout's .*stale or foreign build"):
        loaded, reason = _native._load.__wrapped__()  # uncached: the real load is kept
    assert loaded is stale and reason == ""
    assert "/somewhere/_C.so" in _native.provenance(stale)


@needs_module
def test_the_extension_was_built_from_this_checkout():
    """A stale build (an extension left beside newer sources) would test and time old code."""
    here = _native.source_hash_of_checkout()
    if here is None:
        pytest.skip("an installed package: no sources beside it")
    assert module.source_hash() == here, _native.provenance(module)


def numpy_layout(topk_idx, num_experts, num_ranks):
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    per_expert = np.bincount(topk_idx[valid], minlength=num_experts).astype(np.int32)
    ranks = np.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    in_rank = np.zeros((topk_idx.shape[0], num_ranks + 1), bool)
    np.put_along_axis(in_rank, ranks, True, axis=1)
    in_rank = in_rank[:, :num_ranks]
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank


def random_topk(rng, num_tokens, num_topk, num_experts):
    # distinct experts per token, like a router's top-k
    ids = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :num_topk]
    ids = ids.astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = -1                          # no expert
    ids[rng.random(ids.shape) < 0.02] = num_experts + 3            # out of range: ignored
    return ids


def ffi_layout(topk_idx, num_experts, num_ranks):
    import jax
    import jax.numpy as jnp

    _native.register()
    num_tokens = topk_idx.shape[0]
    call = jax.ffi.ffi_call(
        "jax_ep_layout",
        (jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
         jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((num_tokens, num_ranks), jnp.bool_)))
    fn = jax.jit(lambda t: call(t, num_experts=np.int64(num_experts),
                                num_ranks=np.int64(num_ranks)))
    return [np.asarray(a) for a in fn(jnp.asarray(topk_idx))]


@pytest.mark.parametrize("num_tokens,num_topk,num_experts,num_ranks",
                         [(4096, 8, 256, 8), (1000, 6, 64, 2), (37, 4, 96, 48), (0, 8, 16, 4),
                          (300, 2, 8, 1)])
def test_layout_on_gpu_matches_numpy(num_tokens, num_topk, num_experts, num_ranks):
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    rng = np.random.default_rng(num_tokens + num_experts)
    topk_idx = random_topk(rng, num_tokens, num_topk, num_experts)
    got = ffi_layout(topk_idx, num_experts, num_ranks)
    for g, w, name in zip(got, numpy_layout(topk_idx, num_experts, num_ranks),
                          ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_layout_rejects_bad_attributes_on_gpu():
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(Exception, match="multiple of num_ranks"):
        ffi_layout(np.zeros((4, 2), np.int32), 10, 4)
