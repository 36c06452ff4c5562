"""The benchmarks' reading of the kernels' profile ring (benchmarks/timing.py), on made-up
stamps: rows per handler call and the retirement fallback; and its per-call split of a
profiler trace (made-up GPU activities)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
timing = pytest.importorskip("timing")


def _ring(calls):
    """Profile ring values: calls = {row: {kernel: (enter, waited, first end, last end,
    retired)}} in ns; untouched stamps as profile_reset leaves them."""
    n, k = timing.PROFILE_PHASES, timing.PROFILE_KERNELS
    values = []
    for row in range(64):
        for kernel in timing.KERNELS + [None] * (k - len(timing.KERNELS)):
            stamps = calls.get(row, {}).get(kernel)
            values += list(stamps) if stamps else [2**64 - 1, 0, 2**64 - 1, 0, 0]
    assert len(values) == 64 * k * n
    return values


def test_profile_rows():
    values = _ring({
        0: {"dispatch_stage": (1000, 1100, 1900, 2000, 2500),
            "dispatch_fused": (3000, 3100, 8000, 9000, 9400)},
        # a low-latency kernel: no retirement stamp, its last end counts
        2: {"ll_dispatch_send": (20000, 20500, 21000, 22000, 0)},
    })
    rows = timing.profile_rows(values)
    assert [r for r, _ in rows] == [0, 2]
    assert dict(rows[0][1])["dispatch_fused"] == (3000, 3100, 8000, 9000, 9400)
    assert dict(rows[1][1])["ll_dispatch_send"][4] == 22000


def test_empty_ring():
    assert timing.profile_rows(_ring({})) == []


# as CUPTI names them (a profiler trace of the low-latency benchmark on 2×H200)
_SEND = ("__nv_static_36__7fb8699b_14_low_latency_cu_5365d4e9__ZN6jax_ep47_GLOBAL__N__7fb8699b_"
         "14_low_latency_cu_5365d4e918ll_dispatch_kernelENS_18LLDispatchSendArgsENS_21LLDispatch"
         "ReceiveArgsE")


def _chain(calls):
    """GPU activities of a chain: per call, a 20 µs jax_ep kernel, 1 µs idle, a 2 µs XLA
    fusion, 1 µs idle (24 µs a call), in ns."""
    events, t = [], 5000
    for _ in range(calls):
        events += [(t, 20000, _SEND), (t + 21000, 2000, "loop_add_fusion_1")]
        t += 24000
    return events


def test_call_profile_splits_each_call():
    p = timing.call_profile(_chain(20), 20)
    assert p["calls"] > 10
    assert p["cycle"] == pytest.approx(24.0)
    assert p["kernels"] == pytest.approx(20.0)
    assert p["other"] == pytest.approx(2.0)
    assert p["idle"] == pytest.approx(2.0)
    assert p["per_name"] == {"ll_dispatch_kernel": pytest.approx(20.0),
                             "loop_add_fusion_1": pytest.approx(2.0)}


def test_call_profile_spans_kernels_beside_each_other():
    """A split call: its send beside a GEMM, its sum after it; each kernel's first start and
    last end from the call's first kernel of ours (medians)."""
    events, t = [], 5000
    for _ in range(20):
        events += [(t, 70000, _SEND), (t + 3000, 72000, "sm90_xmma_gemm"),
                   (t + 78000, 10000, _SEND.replace("18ll_dispatch_kernel", "13ll_sum_kernel")),
                   (t + 78500, 1000, "sm90_xmma_gemm")]  # a second launch: the last end
        t += 100000
    p = timing.call_profile(events, 20)
    assert p["cycle"] == pytest.approx(100.0)
    assert p["spans"]["ll_dispatch_kernel"] == (pytest.approx(0.0), pytest.approx(70.0))
    assert p["spans"]["sm90_xmma_gemm"] == (pytest.approx(3.0), pytest.approx(79.5))
    assert p["spans"]["ll_sum_kernel"] == (pytest.approx(78.0), pytest.approx(88.0))
    assert p["per_name"]["sm90_xmma_gemm"] == pytest.approx(73.0)


def test_call_profile_needs_the_calls():
    assert timing.call_profile([(0, 1000, "loop_add_fusion_1")], 10) is None
    assert timing.call_profile(_chain(7), 10) is None  # not a multiple of the calls


def test_kernel_names():
    assert timing.kernel_name(_SEND) == "ll_dispatch_kernel"
    stage = ("_ZN6jax_ep54_GLOBAL__N__f8511027_21_intranode_dispatch_cu_186ab7df20dispatch_stage_"
             "ranksILb0EEEvNS_12DispatchArgsE")
    assert timing.kernel_name(stage) == "dispatch_stage_ranks"
    fused = ("_ZN6jax_ep54_GLOBAL__N__f8511027_21_intranode_dispatch_cu_186ab7df14dispatch_fused"
             "ILb0ELi2EEEvNS_12DispatchArgsE")
    assert timing.kernel_name(fused) == "dispatch_fused"
    assert timing.kernel_name("sm90_xmma_gemm") == "sm90_xmma_gemm"
    assert timing.kernel_name("loop_add_fusion_1") == "loop_add_fusion_1"


def test_looped_rounds_loop_the_unrolled_chain():
    """looped(body, calls, rounds=r): the chain of `calls` calls is traced (unrolled) once and
    run r times in a while loop; without rounds there is no loop."""
    import jax
    import jax.numpy as jnp

    traced = []

    def body(x, n):
        traced.append(1)  # once per unrolled call
        return jnp.sum(x) + n[0]

    args = (jnp.ones(4), jnp.zeros(2))
    looped = jax.jit(timing.looped(body, 5, chained=1, rounds=4))
    first, seen = looped(*args)
    assert first.shape == seen.shape == (1,)
    assert float(seen[0]) == 4 * 5 * 4.0  # every call's output read once at its chain's end
    assert len(traced) == 5
    assert "while" in looped.lower(*args).as_text()
    assert "while" not in jax.jit(timing.looped(body, 5, chained=1)).lower(*args).as_text()


def test_host_us_per_call_sums_the_median_of_each_custom_call(monkeypatch):
    class FakeModule:
        def __init__(self, times):
            self.times, self.resets = times, 0

        def handler_host_times(self, reset=False):
            self.resets += reset
            return self.times

    fake = FakeModule({"jax_ep_dispatch": [1000, 90000, 2000], "jax_ep_combine": [500]})
    monkeypatch.setattr(timing, "_native_module", lambda: fake)
    timing.host_times_reset()
    assert fake.resets == 1
    # medians 2000 ns (the blocked 90 µs execution left out) and 500 ns
    assert timing.host_us_per_call() == pytest.approx(2.5)
    fake.times = {}
    assert timing.host_us_per_call() != timing.host_us_per_call()  # NaN: nothing ran
    monkeypatch.setattr(timing, "_native_module", lambda: None)
    timing.host_times_reset()
    assert timing.host_us_per_call() != timing.host_us_per_call()


def test_copy_host_breakdown_per_call(monkeypatch):
    class FakeModule:
        def handler_host_times(self, reset=False):
            return {"jax_ep_dispatch": [100_000, 100_000, 100_000, 900_000]}

        def copy_engine_host_times(self, reset=False):
            # one memcpy blocked on a full queue: the median leaves it out
            return {"memcpy": (120, [2_000] * 119 + [800_000]), "flag": (120, [600] * 120),
                    "join": (0, [])}

    monkeypatch.setattr(timing, "_native_module", lambda: FakeModule())
    median, got = timing.copy_host_breakdown()
    assert median == pytest.approx(100.0)
    assert got["memcpy"] == pytest.approx((30, 60.0))  # 4 executions, 30 calls of 2 µs each
    assert got["flag"] == pytest.approx((30, 18.0))
    assert "join" not in got  # no calls of that kind


def test_a_chain_keeps_every_call_and_adds_no_op_between_them():
    """looped() orders its calls by optimization barriers: XLA keeps every call (none merged
    as the same or dropped as unused, also for integer bodies) and the chain adds no
    arithmetic of its own between the calls, only one fusion at the end."""
    import jax
    import jax.numpy as jnp

    def body(a):
        return jnp.sum(a * 3)  # stands for a call XLA may merge when its operands match

    f = jax.jit(timing.looped(body, 5, chained=0))
    text = f.lower(jnp.arange(64, dtype=jnp.int32)).as_text()
    assert text.count("stablehlo.reduce") == 5, text
    assert text.count("stablehlo.optimization_barrier") == 5, text
    assert "stablehlo.subtract" not in text, text
    assert int(f(jnp.arange(64, dtype=jnp.int32))[1][0]) == 5 * 3 * sum(range(64))
    # XLA keeps the barriers until after its common-subexpression pass from jax 0.11 on (the
    # benchmarks' GPU image); jax 0.10's XLA:CPU expanded them first and merged the 5 calls
    if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11):
        compiled = f.lower(jnp.arange(64, dtype=jnp.int32)).compile().as_text()
        assert compiled.count("reduce(") >= 5, compiled


def test_kernel_details_reads_cuptis_launch_details(monkeypatch):
    # made-up profile data: a GPU plane with a kernel carrying CUPTI's details, a memset
    # without, and a host plane that must be ignored
    class Event:
        def __init__(self, name, stats):
            self.name, self.stats = name, list(stats.items())

    class Line:
        def __init__(self, events):
            self.events = events

    class Plane:
        def __init__(self, name, lines):
            self.name, self.lines = name, lines

    class Data:
        planes = [
            Plane("/host:CPU", [Line([Event("_ZN6jax_ep4hostEv", {"kernel_details": "x"})])]),
            Plane("/device:GPU:0", [Line([
                Event("sm90_gemm", {"kernel_details": "regs:168 grid:132,1,1 block:384,1,1"}),
                Event("Memset 3", {}),
                Event("sm90_gemm", {"kernel_details": "a later launch"}),
            ])]),
        ]

    monkeypatch.setattr(timing, "_profiled", lambda f, *a: Data())
    assert timing.kernel_details(None) == {"sm90_gemm": "regs:168 grid:132,1,1 block:384,1,1"}
    monkeypatch.setattr(timing, "_profiled", lambda f, *a: None)
    assert timing.kernel_details(None) == {}


class _Events:
    """Iterable but not sized, as the profiler's events of a line are."""

    def __init__(self, events):
        self._events = events

    def __iter__(self):
        return iter(self._events)


def test_own_gpu_plane_is_the_one_with_activity():
    # a process sees its peer's GPU too: CUPTI gives that one a plane of its own, empty, and
    # it may sort first (rank 1 runs on /device:GPU:1)
    from types import SimpleNamespace as NS

    def plane(name, n):
        line = NS(name="stream 7", events=_Events([NS(start_ns=i, duration_ns=1, name="k")
                                                    for i in range(n)]))
        return NS(name=name, lines=[line])

    data = NS(planes=[plane("/host:CPU", 9), plane("/device:GPU:0", 0),
                      plane("/device:GPU:1", 3)])
    assert timing._own_gpu_plane(data).name == "/device:GPU:1"
    assert timing._own_gpu_plane(NS(planes=[plane("/host:CPU", 2)])) is None
