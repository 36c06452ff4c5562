"""Failure behaviour on GPUs: a missing peer ends in an error naming it, never a hang.

Runs its own 2-process job through the launcher, so it needs 2 visible GPUs and must itself
run outside the launcher (the GPU suite's command runs it: see README).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from jax_ep import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reason():
    if os.environ.get("JAX_EP_RUN_FAILURE_TESTS") != "1":
        # Opt-in: it takes ~30 s and two GPUs that no other job uses.
        return "opt-in: set JAX_EP_RUN_FAILURE_TESTS=1 (needs 2 idle GPUs, ~30 s)"
    if "JAX_EP_RANK" in os.environ:
        return "starts its own processes: run it outside the launcher"
    if launch._local_gpu_count() < 2:
        return "needs 2 visible GPUs"
    from jax_ep import _native

    module, why = _native.load()
    return None if module is not None else why


@pytest.mark.skipif(_reason() is not None, reason=f"GPU failure tests: {_reason()}")
@pytest.mark.parametrize("across_nodes", [False, True], ids=["one_node", "across_nodes"])
def test_missing_peer_times_out_with_its_name(across_nodes):
    """across_nodes: two virtual nodes, a low-latency dispatch awaiting the peer's signal."""
    env = dict(os.environ, JAX_EP_TIMEOUT_S="3", PYTHONPATH=REPO,
               XLA_FLAGS="")
    env.pop("JAX_PLATFORMS", None)  # conftest pins this process to the CPU; the job needs GPUs
    probe = os.path.join(REPO, "tests", "gpu_timeout_probe.py")
    command = [sys.executable, "-m", "jax_ep.launch", "-n", "2", probe]
    proc = subprocess.Popen(command + (["--across-nodes"] if across_nodes else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    hung = False
    try:
        text, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        hung = True
    if os.environ.get("JAX_EP_FAILURE_LOG"):
        with open(os.environ["JAX_EP_FAILURE_LOG"], "w") as f:
            f.write(text)
    assert not hung, "the job did not end within 120 s:\n" + text[-4000:]
    assert proc.returncode != 0, text[-3000:]
    assert "UNEXPECTED" not in text
    assert "timed out after 3.0 s waiting for PE 1" in text, text[-3000:]
