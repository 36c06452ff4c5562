"""Failure behaviour on GPUs: a missing peer ends in an error naming it, never a hang.

Runs its own 2-process job through the launcher, so it needs 2 visible GPUs and must itself
run outside the launcher (the GPU suite's command runs it: see README).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jax_ep import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reason():
    if os.environ.get("JAX_EP_RUN_FAILURE_TESTS") != "1":
        # On 2xH200 (2026-11-23) an earlier version of the probe (no os._exit, rank 1 asleep
        # for 120 s) hung past 240 s: most likely jax.distributed's shutdown barrier or the
        # teardown of the trapped context, not the kernel's wait. Not rerun since.
        return "opt-in (JAX_EP_RUN_FAILURE_TESTS=1) until the hang seen on 2xH200 is understood"
    if "JAX_EP_RANK" in os.environ:
        return "starts its own processes: run it outside the launcher"
    if launch._local_gpu_count() < 2:
        return "needs 2 visible GPUs"
    from jax_ep import _native

    module, why = _native.load()
    return None if module is not None else why


@pytest.mark.skipif(_reason() is not None, reason=f"GPU failure tests: {_reason()}")
def test_missing_peer_times_out_with_its_name():
    env = dict(os.environ, JAX_EP_TIMEOUT_S="3", PYTHONPATH=REPO, XLA_FLAGS="")
    env.pop("JAX_PLATFORMS", None)  # conftest pins this process to the CPU; the job needs GPUs
    probe = os.path.join(REPO, "tests", "gpu_timeout_probe.py")
    out = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "2", probe],
                         capture_output=True, text=True, env=env, timeout=90)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "UNEXPECTED" not in text
    assert "timed out after 3.0 s waiting for PE 1" in text, text[-3000:]
