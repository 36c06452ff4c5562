"""The launcher on CPU: jax.distributed across processes, rank-prefixed output, failure handling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(tmp_path, body, n=2, timeout=120, extra=()):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep +
               os.path.join(REPO, "tests"), XLA_FLAGS="")
    return subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), *extra,
                           str(script)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def test_ranks_join_one_jax_distributed_job(tmp_path):
    out = launch(tmp_path, """
        import os
        import jax
        from jax._src import distributed
        from jax_ep import launch
        assert launch.init_distributed()
        assert os.environ["JAX_EP_LOCAL_DEVICE"] == os.environ["JAX_EP_RANK"]
        me = jax.process_index()
        client = distributed.global_state.client
        client.key_value_set(f"test/{me}", f"hello from {me}")
        other = client.blocking_key_value_get(f"test/{1 - me}", 60_000)
        print("process", me, "of", jax.process_count(), "devices", jax.device_count(),
              "heard", repr(other))
    """)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank 0] process 0 of 2 devices 2 heard 'hello from 1'" in out.stdout
    assert "[rank 1] process 1 of 2 devices 2 heard 'hello from 0'" in out.stdout


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


def test_an_aborted_rank_is_named_with_its_signal(tmp_path):
    out = launch(tmp_path, """
        import os, sys, time
        if os.environ["JAX_EP_RANK"] == "1":
            print("rank one aborts", flush=True)
            os.abort()
        time.sleep(60)
    """)
    assert out.returncode == 128 + 6
    assert "[rank 1] rank one aborts" in out.stdout
    assert "rank 1 exited with -6 (SIGABRT" in out.stderr and "--capture=sys" in out.stderr


def test_the_coordinator_port_is_free_and_outside_the_ephemeral_range(monkeypatch):
    """A port from bind(0) may go to any outgoing connection before rank 0's coordinator binds
    it; the launcher's own choice is a free one outside the kernel's ephemeral range."""
    import socket

    from jax_ep import launch

    low, high = launch._ephemeral_ports()
    for _ in range(20):
        port = launch._free_port()
        assert not low <= port <= high and 1024 <= port < 65536
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
    # a range set low: the port comes from above it
    monkeypatch.setattr(launch, "_ephemeral_ports", lambda: (1024, 40000))
    assert 40000 < launch._free_port() < 65536
    # a port taken is not chosen
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        taken = s.getsockname()[1]
        assert not launch._bindable(taken)


def test_not_launched_is_a_no_op():
    from jax_ep import launch

    if "JAX_EP_RANK" in os.environ:
        pytest.skip("running under the launcher")
    assert launch.init_distributed() is False


def test_several_hosts_need_a_coordinator(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("")
    out = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "2", "--num-processes",
                          "4", str(script)], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert out.returncode == 2
    assert "--coordinator" in out.stderr


def test_shared_gpus_put_ranks_on_one_device_and_tests_gather_without_nccl(tmp_path):
    out = launch(tmp_path, """
        import os
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jax_ep import launch
        assert launch.init_distributed()
        import ep
        assert ep.SHARED_GPUS and os.environ["JAX_EP_LOCAL_DEVICE"] == "0"
        assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        m = ep.mesh(2)
        want = np.arange(24, dtype=np.float32).reshape(4, 6)
        got = ep.fetch(ep.put(want, NamedSharding(m, P(ep.AXIS))))
        np.testing.assert_array_equal(got, want)
        again = ep.fetch(ep.put(want + 1, NamedSharding(m, P(None, ep.AXIS))))
        np.testing.assert_array_equal(again, want + 1)
        print("gathered", jax.process_index())
    """, extra=("--gpus", "1"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank 0] gathered 0" in out.stdout and "[rank 1] gathered 1" in out.stdout


def test_gpus_must_fit_the_processes(tmp_path):
    out = launch(tmp_path, "print('never')", extra=("--gpus", "3"))
    assert out.returncode != 0 and "--gpus 3" in out.stderr


def test_sigterm_kills_ranks_that_ignore_it(tmp_path):
    # jax.distributed's preemption notifier takes SIGTERM in a rank; `timeout` must still stop it.
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        print("ready", flush=True)
        time.sleep(120)
    """))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-m", "jax_ep.launch", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)
    ready = 0
    while ready < 2:
        ready += "ready" in proc.stdout.readline()
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.time() - start < 30
    assert proc.returncode != 0
    assert "[rank 0] ignoring SIGTERM" in out and "[rank 1] ignoring SIGTERM" in out
    assert "killing them" in err


def _alive(pid):
    """Running (a zombie left to an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-m", "jax_ep.launch", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    pids = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        if " pid " in line:
            pids.append(int(line.split()[-1]))
    proc.kill()  # SIGKILL: the launcher cannot pass anything on
    proc.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived the launcher"


def test_a_closed_output_does_not_hang_the_launcher(tmp_path):
    """`launch ... | head -1`: the launcher stops writing but keeps draining the ranks' output
    (a rank blocked on a full pipe would never end)."""
    script = tmp_path / "script.py"
    script.write_text("for i in range(100000):\n    print('line', i)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-m", "jax_ep.launch", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    proc.stdout.readline()
    proc.stdout.close()
    proc.wait(timeout=60)  # raises TimeoutExpired if it hangs


def test_two_launchers_form_one_job_like_two_hosts(tmp_path):
    """Two invocations on one machine, as on two hosts: a shared loopback coordinator,
    --num-processes 4 and each its --process-id-offset; the four processes are one
    jax.distributed job with global ranks 0..3."""
    import socket

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import os
        import jax
        from jax._src import distributed
        from jax_ep import launch
        assert launch.init_distributed()
        me, n = jax.process_index(), jax.process_count()
        assert me == int(os.environ["JAX_EP_RANK"]) and n == 4
        client = distributed.global_state.client
        client.key_value_set(f"hosts/{me}", os.environ["JAX_EP_LOCAL_RANK"])
        print("process", me, "device", os.environ["JAX_EP_LOCAL_DEVICE"])
        heard = [client.blocking_key_value_get(f"hosts/{p}", 60_000) for p in range(n)]
        print("process", me, "of", n, "devices", jax.device_count(), "local ranks", heard)
    """))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="")
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "jax_ep.launch", "-n", "2", "--num-processes", "4",
         "--process-id-offset", str(offset), "--first-gpu", str(offset),
         "--coordinator", f"127.0.0.1:{port}", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        for offset in (0, 2)]
    outs = [p.communicate(timeout=180) for p in launchers]
    for p, (stdout, stderr) in zip(launchers, outs):
        assert p.returncode == 0, stdout + stderr
    for rank, host in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert (f"[rank {rank}] process {rank} of 4 devices 4 local ranks "
                f"['0', '1', '0', '1']") in outs[host][0]
        # each invocation on its own GPUs (--first-gpu): as on one machine of 4
        assert f"[rank {rank}] process {rank} device {rank}" in outs[host][0]


def test_ep_across_processes_on_the_cpu():
    """tests/test_across_processes.py under the launcher: two processes of two CPU devices form
    one job, and EP across them (dispatch, combine, low latency, the MoE layer with a data axis
    across the processes or EP across them, gradients) matches the oracles, as across hosts."""
    import re

    import jax

    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10):
        pytest.skip(f"jax {jax.__version__}: its CPU collectives across processes time out "
                    "setting up Gloo contexts (seen at 0.6.1; 0.10 and later pass)")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", XLA_FLAGS="",
               PYTHONPATH=REPO + os.pathsep + os.path.join(REPO, "tests"))
    out = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "2", "--", "-m", "pytest",
                          "-q", "-p", "no:cacheprovider", "--capture=sys",
                          os.path.join("tests", "test_across_processes.py")],
                         capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    tail = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    for rank in (0, 1):
        summary = re.search(rf"^\[rank {rank}\] (\d+ passed.*)$", out.stdout, re.MULTILINE)
        assert summary, tail
        assert "skipped" not in summary.group(1) and "failed" not in summary.group(1), tail

