"""The launcher on CPU: jax.distributed across processes, rank-prefixed output, failure handling."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(tmp_path, body, n=2, timeout=120):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="")
    return subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), str(script)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def test_ranks_join_one_jax_distributed_job(tmp_path):
    out = launch(tmp_path, """
        import jax
        from jax_ep import launch
        assert launch.init_distributed()
        print("process", jax.process_index(), "of", jax.process_count(),
              "devices", jax.device_count())
    """)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank 0] process 0 of 2 devices 2" in out.stdout
    assert "[rank 1] process 1 of 2 devices 2" in out.stdout


def test_one_failing_rank_stops_all_and_fails(tmp_path):
    start = time.time()
    out = launch(tmp_path, """
        import os, sys, time
        if os.environ["JAX_EP_RANK"] == "1":
            print("rank one gives up")
            sys.exit(3)
        time.sleep(60)
    """)
    assert out.returncode == 3
    assert "[rank 1] rank one gives up" in out.stdout
    assert "rank 1 exited with 3" in out.stderr
    assert time.time() - start < 40


def test_not_launched_is_a_no_op():
    from jax_ep import launch

    if "JAX_EP_RANK" in os.environ:
        pytest.skip("running under the launcher")
    assert launch.init_distributed() is False
