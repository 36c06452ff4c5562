"""The multi-host launch on one machine with 4 GPUs: two launcher invocations of 2 processes
each, sharing a loopback coordinator (``--num-processes 4``, each its ``--process-id-offset``
and its own GPUs, ``--first-gpu``), as two hosts would run. They run the node tests (virtual
nodes of 2: low-latency EP across the nodes, the normal mode inside a node with a data axis
across nodes) and the example with a data axis on the CUDA kernels.

Starts its own processes: run it outside the launcher, on a machine with 4 idle GPUs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from jax_ep import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reason():
    if "JAX_EP_RANK" in os.environ:
        return "starts its own processes: run it outside the launcher"
    if launch._local_gpu_count() < 4:
        return "needs 4 visible GPUs"
    from jax_ep import _native

    module, why = _native.load()
    return None if module is not None else why


pytestmark = pytest.mark.skipif(_reason() is not None, reason=f"multi-host launch: {_reason()}")


def _two_invocations(*command, timeout=400):
    """[(returncode, output)] of the two launcher invocations running `command`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("JAX_PLATFORMS", None)  # conftest pins this process to the CPU; the job needs GPUs
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jax_ep.launch", "-n", "2", "--num-processes", "4",
         "--process-id-offset", str(offset), "--first-gpu", str(offset),
         "--coordinator", f"127.0.0.1:{port}", *command],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
        for offset in (0, 2)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


def test_node_tests_pass_over_two_invocations():
    results = _two_invocations("--", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_gpu_nodes.py")
    for code, out in results:
        assert code == 0, out[-4000:]
    summary = [line for line in results[0][1].splitlines()
               if line.startswith("[rank 0] ") and " passed" in line]
    assert summary and "failed" not in summary[-1] and "error" not in summary[-1], \
        results[0][1][-3000:]


def test_example_trains_over_two_invocations():
    results = _two_invocations("examples/moe_layer.py", "--data-parallel", "2", "--backend",
                               "cuda", "--steps", "8")
    for code, out in results:
        assert code == 0, out[-4000:]
    text = results[0][1]
    assert "2 EP group(s) of 2" in text, text[-3000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in text.splitlines()
              if line.startswith("[rank 0] step")]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], text[-3000:]
