"""runtime.initialize's agreement step: before NVSHMEM starts, the processes compare their
buffer sizes and data-path variables through jax.distributed's key-value store, so that a
mismatch is an error on every process instead of a hang in a collective allocation or a wait
for data a peer never sends. Needs neither a GPU nor the extension."""

from __future__ import annotations

import os
import threading
import time

import pytest

from jax_ep import runtime


class FakeKeyValueStore:
    """The two calls of jax.distributed's client that the exchange uses; gets block until the
    key is set, as the real store's do."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.changed:
            assert key not in self.values, f"{key} set twice"
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.changed:
            assert self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000), key
            return self.values[key]

    def wait_at_barrier(self, barrier_id, timeout_ms):
        with self.changed:
            self.arrived = getattr(self, "arrived", {})
            self.arrived[barrier_id] = self.arrived.get(barrier_id, 0) + 1
            self.changed.notify_all()
            if not self.changed.wait_for(lambda: self.arrived[barrier_id] == self.world,
                                         timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {barrier_id}")


def _exchange_all(settings_by_rank, generation=0, step=runtime._exchange):
    """Every rank's _exchange (or _agree), each in its own thread, as the processes run it;
    [what it returned or raised] by rank."""
    store, world = FakeKeyValueStore(), len(settings_by_rank)
    store.world = world
    results = [None] * world

    def run(rank):
        try:
            results[rank] = step(store, rank, world, generation, dict(settings_by_rank[rank]))
        except Exception as e:  # noqa: BLE001 - the test looks at what each rank raised
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_every_rank_sees_every_ranks_settings_and_host():
    settings = [dict(runtime._shared_settings(1 << 20, 0), buffer_bytes=(1 << 20) + r)
                for r in range(3)]
    results = _exchange_all(settings)
    for seen in results:
        assert [entry["buffer_bytes"] for entry in seen] == [(1 << 20) + r for r in range(3)]
        assert len({entry["host"] for entry in seen}) == 1  # all in this process's host


def test_equal_settings_pass(monkeypatch):
    monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    mine = runtime._shared_settings(1 << 30, 1 << 26)
    assert mine["JAX_EP_DISPATCH"] == "copy" and mine["JAX_EP_COMBINE"] is None
    for seen in _exchange_all([mine] * 4):
        for entry in seen:
            entry.pop("host")
        runtime._check_same_settings(seen)


def test_a_different_size_or_variable_is_named_with_every_ranks_value(monkeypatch):
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    base = runtime._shared_settings(1 << 30, 0)
    settings = [base, dict(base, buffer_bytes=1 << 29), dict(base, JAX_EP_COMBINE="copy")]
    for outcome in _exchange_all(settings, step=runtime._agree):
        assert isinstance(outcome, ValueError), outcome  # every rank, none into NVSHMEM
        message = str(outcome)
        assert f"buffer_bytes (rank 0: {1 << 30}, rank 1: {1 << 29}, rank 2: {1 << 30})" in message
        assert "JAX_EP_COMBINE (rank 0: unset, rank 1: unset, rank 2: copy)" in message
        assert "low_latency_bytes" not in message


def test_equal_settings_agree_on_every_rank():
    import socket

    settings = [runtime._shared_settings(1 << 30, 0)] * 3
    # every rank learns every rank's host (one host here)
    assert _exchange_all(settings, step=runtime._agree) == [[socket.gethostname()] * 3] * 3


def test_nodes_are_hosts_or_virtual_nodes_of_consecutive_ranks():
    assert runtime.nodes_of(["a", "a", "b", "b"]) == [0, 0, 1, 1]
    assert runtime.nodes_of(["b", "b", "a", "a"]) == [0, 0, 1, 1]  # by first appearance
    assert runtime.nodes_of(["a"] * 8, node_size=2) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert runtime.nodes_of(["a", "a", "b", "b"], node_size=2) == [0, 0, 1, 1]
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="node_size must be an int >= 1 dividing the 4"):
            runtime.nodes_of(["a"] * 4, node_size=bad)
    with pytest.raises(ValueError, match=r"node 0 would span the hosts \['a', 'b'\]"):
        runtime.nodes_of(["a", "b", "b", "b"], node_size=2)


def test_a_different_node_size_is_named():
    base = runtime._shared_settings(1 << 30, 0)
    settings = [base, runtime._shared_settings(1 << 30, 0, node_size=1)]
    for outcome in _exchange_all(settings, step=runtime._agree):
        assert isinstance(outcome, ValueError), outcome
        assert "node_size (rank 0: unset, rank 1: 1)" in str(outcome)


def test_one_ranks_bad_arguments_fail_every_rank():
    base = runtime._shared_settings(1 << 30, 0)
    settings = [base, dict(base, buffer_bytes=0, error="ValueError: buffer_bytes must be "
                                                       "positive, got -1"), base]
    for outcome in _exchange_all(settings, step=runtime._agree):
        assert isinstance(outcome, ValueError), outcome
        assert "failed on rank 1: ValueError: buffer_bytes must be positive" in str(outcome)


def test_equal_spellings_compare_equal(monkeypatch):
    monkeypatch.delenv("JAX_EP_DISPATCH", raising=False)
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "4")
    unset = runtime._shared_settings(1, 0)
    monkeypatch.setenv("JAX_EP_DISPATCH", "fused")
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "4.0")
    runtime._check_same_settings([unset, runtime._shared_settings(1, 0)])


def test_the_shared_variables_are_the_ones_the_backend_reads():
    """Each shared variable changes what the CUDA backend or the kernels do with the peers."""
    import pathlib

    root = pathlib.Path(runtime.__file__).parents[1]
    files = [*(root / "jax_ep").glob("*.py"), *(root / "ffi").rglob("*.c[cu]")]
    sources = "".join(p.read_text() for p in files if p.name != "runtime.py")
    for name in runtime.SHARED_VARIABLES:
        assert f'"{name}"' in sources, name


def test_a_rank_arriving_after_the_others_gave_up_fails_at_the_barrier(monkeypatch):
    """Rank 0 times out waiting for rank 1's settings; rank 1 arrives later, finds them all
    and agrees, but must not go on into NVSHMEM's bootstrap (nobody would join it)."""
    store, settings = FakeKeyValueStore(), runtime._shared_settings(1 << 30, 0)
    store.world = 2
    with pytest.raises(AssertionError):  # the fake store's timeout
        runtime._agree(store, 0, 2, 0, dict(settings), 0.2)
    with pytest.raises(RuntimeError, match="DEADLINE_EXCEEDED"):
        runtime._agree(store, 1, 2, 0, dict(settings), 0.2)


def test_agreement_through_jax_distributed_on_cpu(tmp_path):
    """The same steps through the real jax.distributed client (two CPU processes): equal
    settings agree, then a variable set on one rank only fails both."""
    import os
    import subprocess
    import sys
    import textwrap

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent("""
        import os
        import jax
        from jax._src import distributed
        from jax_ep import launch, runtime
        assert launch.init_distributed()
        client, me = distributed.global_state.client, jax.process_index()
        os.environ.pop("JAX_EP_COMBINE", None)
        print("agreed", runtime._agree(client, me, 2, 0, runtime._shared_settings(64, 0)))
        if me == 1:
            os.environ["JAX_EP_COMBINE"] = "copy"
        try:
            runtime._agree(client, me, 2, 1, runtime._shared_settings(64, 0))
            print("went on")
        except ValueError as e:
            print("refused:", e)
    """))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "2", str(script)],
                         capture_output=True, text=True, env=env, timeout=120, cwd=repo)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] agreed ['" in out.stdout
        assert (f"[rank {rank}] refused: jax_ep.runtime.initialize: every process must pass "
                "the same sizes and set the same jax_ep variables; they differ in "
                "JAX_EP_COMBINE (rank 0: unset, rank 1: copy)") in out.stdout, out.stdout
    assert "went on" not in out.stdout


def test_a_different_process_config_is_named():
    import jax_ep

    base = runtime._shared_settings(1 << 30, 0, jax_ep.Config(num_blocks=24))
    other = runtime._shared_settings(1 << 30, 0, jax_ep.Config(num_blocks=32))
    runtime._check_same_settings([base, dict(base)])
    with pytest.raises(ValueError, match=r"config \(rank 0: .*'num_blocks': 24.*rank 1: "
                                         r".*'num_blocks': 32"):
        runtime._check_same_settings([base, other])


class FakeBytesStore(FakeKeyValueStore):
    key_value_set_bytes = FakeKeyValueStore.key_value_set
    blocking_key_value_get_bytes = FakeKeyValueStore.blocking_key_value_get


class FakeWindows:
    """The extension's open_xla_windows: records, for each call, which pipe each descriptor
    reaches (its inode) with the bases and sizes; refuses to map when told."""

    def __init__(self, refuse=False):
        self.refuse, self.calls = refuse, []

    def open_xla_windows(self, fds, bases, sizes):
        if self.refuse and any(fd >= 0 for fd in fds):
            raise RuntimeError("cuMemMap(XLA's allocation of PE 0) failed (CUresult 1)")
        self.calls.append(([os.fstat(fd).st_ino if fd >= 0 else None for fd in fds],
                           list(bases), list(sizes)))


def _open_windows_on_every_rank(exportable, nodes=None, refuse=(), timeout_s=5.0):
    """Runs _open_xla_windows on a thread per rank; rank r exports a pipe's write end (or
    nothing where exportable[r] is false). Returns the results, the fake extensions and the
    inode each rank exported."""
    store, world = FakeBytesStore(), len(exportable)
    nodes = nodes or [0] * world
    modules = [FakeWindows(refuse=r in refuse) for r in range(world)]
    pipes = [os.pipe() for _ in range(world)]
    results = [None] * world

    def run(rank):
        fd = pipes[rank][1] if exportable[rank] else -1
        results[rank] = runtime._open_xla_windows(modules[rank], store, rank, world, 0,
                                                  (fd, 4096 * (rank + 1), 1 << 30), nodes,
                                                  timeout_s)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    inodes = [os.fstat(w).st_ino for _, w in pipes]
    for read_end, write_end in pipes:
        os.close(read_end)
        os.close(write_end)
    return results, modules, inodes


def test_xla_windows_pass_every_descriptor_to_the_processes_of_its_node():
    results, modules, inodes = _open_windows_on_every_rank([True] * 3)
    assert results == [True] * 3
    for module in modules:  # each rank maps every rank's own allocation (its pipe)
        assert module.calls == [(inodes, [4096, 8192, 12288], [1 << 30] * 3)]


def test_xla_windows_stay_within_a_node():
    results, modules, inodes = _open_windows_on_every_rank([True] * 4, nodes=[0, 0, 1, 1])
    assert results == [True] * 4
    assert modules[0].calls[0][0] == [inodes[0], inodes[1], None, None]
    assert modules[3].calls[0][0] == [None, None, inodes[2], inodes[3]]
    # a node of one process has nobody to pass its descriptor to
    results, modules, inodes = _open_windows_on_every_rank([True] * 2, nodes=[0, 1])
    assert results == [True] * 2
    assert modules[0].calls[0][0] == [inodes[0], None]


def test_xla_windows_are_all_or_nothing():
    # a rank whose allocation cannot be exported: nobody maps anything
    results, modules, _ = _open_windows_on_every_rank([True, False, True])
    assert results == [False] * 3 and all(m.calls == [] for m in modules)
    # a rank that cannot map a peer's: the others close what they mapped
    results, modules, _ = _open_windows_on_every_rank([True, True], refuse={1})
    assert results == [False, False]
    assert modules[0].calls[-1] == ([None, None], [0, 0], [0, 0]) and modules[1].calls == []


def test_xla_windows_give_up_at_once_where_a_descriptor_cannot_be_sent(monkeypatch):
    # rank 1 listens under another name than it posts: the others' sends to it fail, and
    # nobody waits out the timeout for a descriptor that never comes
    listen = runtime._listen

    def listen_elsewhere(name, backlog):
        hidden = threading.current_thread().name == "rank-1"
        return listen(name + "-elsewhere" if hidden else name, backlog)

    monkeypatch.setattr(runtime, "_listen", listen_elsewhere)
    store, modules = FakeBytesStore(), [FakeWindows() for _ in range(3)]
    pipes = [os.pipe() for _ in range(3)]
    results = [None] * 3

    def run(rank):
        results[rank] = runtime._open_xla_windows(modules[rank], store, rank, 3, 0,
                                                  (pipes[rank][1], 4096, 1 << 30), [0] * 3, 30.0)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(3)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    assert results == [False] * 3 and all(m.calls == [] for m in modules)
    assert time.monotonic() - start < 10
    for read_end, write_end in pipes:
        os.close(read_end)
        os.close(write_end)


def test_an_array_is_held_by_the_window_only_where_it_lies_inside_it(monkeypatch):
    import jax.numpy as jnp

    x = jnp.arange(1024, dtype=jnp.float32).block_until_ready()
    start, nbytes = x.unsafe_buffer_pointer(), x.nbytes
    monkeypatch.setattr(runtime, "_xla_windows_open", False)
    monkeypatch.setattr(runtime, "_xla_window", (start, nbytes))
    assert not runtime.xla_window_holds(x)  # no window open: nothing is reached in place
    monkeypatch.setattr(runtime, "_xla_windows_open", True)
    assert runtime.xla_window_holds(x)
    monkeypatch.setattr(runtime, "_xla_window", (start - 4096, 4096 + nbytes))
    assert runtime.xla_window_holds(x)
    # the platform allocator's case: the window is another allocation, or ends inside x
    monkeypatch.setattr(runtime, "_xla_window", (start + nbytes, 1 << 20))
    assert not runtime.xla_window_holds(x)
    monkeypatch.setattr(runtime, "_xla_window", (start, nbytes - 4))
    assert not runtime.xla_window_holds(x)
    monkeypatch.setattr(runtime, "_xla_window", (0, 0))
    assert not runtime.xla_window_holds(x)
