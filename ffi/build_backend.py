"""PEP 517 backend: scikit-build-core, plus the native build's Python-side needs on demand.

When a CUDA compiler is available the CMake build reads the XLA FFI headers from jaxlib and
links NVSHMEM from the nvidia-nvshmem wheel of the same CUDA major version as nvcc; both are
large, so they are build requirements only then. ``JAX_EP_NATIVE=OFF`` skips the native build.

An isolated build gets the newest jaxlib and NVSHMEM from the index. NVSHMEM's device library is
linked into the extension and must match the host library it loads at run time (the runtime
checks), so where an environment already has its own NVSHMEM (and jaxlib) build against them:
``pip install --no-build-isolation .`` (with scikit-build-core and nanobind installed).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F403 - re-export the PEP 517/660 hooks


def _cuda_major():
    if os.environ.get("JAX_EP_NATIVE", "AUTO").upper() == "OFF":
        return None
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc and os.environ.get("CUDA_HOME"):
        nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.", out)
    return int(match.group(1)) if match else None


def _native_requires():
    major = _cuda_major()
    if major is None:
        return []
    return ["jaxlib>=0.6.1", f"nvidia-nvshmem-cu{major}>=3.3"]


def get_requires_for_build_wheel(config_settings=None):
    return _skbuild.get_requires_for_build_wheel(config_settings) + _native_requires()


def get_requires_for_build_editable(config_settings=None):
    return _skbuild.get_requires_for_build_editable(config_settings) + _native_requires()
