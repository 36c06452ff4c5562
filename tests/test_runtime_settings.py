"""runtime.initialize's agreement step: before NVSHMEM starts, the processes compare their
buffer sizes and data-path variables through jax.distributed's key-value store, so that a
mismatch is an error on every process instead of a hang in a collective allocation or a wait
for data a peer never sends. Needs neither a GPU nor the extension."""

from __future__ import annotations

import threading

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


def _exchange_all(settings_by_rank, generation=0):
    """Every rank's _exchange, each in its own thread, as the processes run it."""
    store, world = FakeKeyValueStore(), len(settings_by_rank)
    results = [None] * world

    def run(rank):
        results[rank] = runtime._exchange(store, rank, world, generation,
                                          settings_by_rank[rank])

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
    monkeypatch.delenv("JAX_EP_NUM_BLOCKS", raising=False)
    mine = runtime._shared_settings(1 << 30, 1 << 26)
    assert mine["JAX_EP_DISPATCH"] == "copy" and mine["JAX_EP_NUM_BLOCKS"] is None
    for seen in _exchange_all([mine] * 4):
        for entry in seen:
            entry.pop("host")
        runtime._check_same_settings(seen)


def test_a_different_size_or_variable_is_named_with_every_ranks_value(monkeypatch):
    monkeypatch.delenv("JAX_EP_NUM_BLOCKS", raising=False)
    base = runtime._shared_settings(1 << 30, 0)
    settings = [base, dict(base, buffer_bytes=1 << 29), dict(base, JAX_EP_NUM_BLOCKS="24")]
    for seen in _exchange_all(settings):
        for entry in seen:
            entry.pop("host")
        with pytest.raises(ValueError) as error:
            runtime._check_same_settings(seen)
        message = str(error.value)
        assert f"buffer_bytes (rank 0: {1 << 30}, rank 1: {1 << 29}, rank 2: {1 << 30})" in message
        assert "JAX_EP_NUM_BLOCKS (rank 0: unset, rank 1: unset, rank 2: 24)" in message
        assert "low_latency_bytes" not in message


def test_the_shared_variables_are_the_ones_the_backend_reads():
    """Each shared variable changes what the CUDA backend or the kernels do with the peers."""
    import pathlib

    root = pathlib.Path(runtime.__file__).parents[1]
    files = [*(root / "jax_ep").glob("*.py"), *(root / "ffi").rglob("*.c[cu]")]
    sources = "".join(p.read_text() for p in files if p.name != "runtime.py")
    for name in runtime.SHARED_VARIABLES:
        assert f'"{name}"' in sources, name
