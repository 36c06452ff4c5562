"""What the GPU runs between chained jax_ep calls: a JAX profiler (CUPTI) trace of a few
chained calls, printed as rank 0's GPU timeline (every kernel, memset and copy, with the idle
time before it) next to the host's launch times of the same program.

    python -m jax_ep.launch -n 2 benchmarks/trace_calls.py [--rows ll_fp8,ll_dc,push,push_fp8]

Nsight Systems cannot write reports on the device machines; the profiler built into jaxlib
can, and `jax.profiler.ProfileData` reads its trace without TensorBoard.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep

from timing import looped, put, seconds_per_call

AXIS = "ep"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="ll_fp8,ll_dc,ll_split,matmul,push,push_fp8")
    p.add_argument("--calls", type=int, default=100, help="chained calls in the traced program")
    p.add_argument("--show", type=int, default=2, help="calls printed (from the middle)")
    return p.parse_args()


def gpu_events(trace_dir):
    """(start_ns, duration_ns, name, line) of every event on this process's GPU plane."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    events, host = [], []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                for e in line.events:
                    events.append((e.start_ns, e.duration_ns, e.name, line.name))
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for e in line.events:
                    host.append((e.start_ns, e.duration_ns, e.name, line.name))
    return sorted(events), sorted(host)


def short(name):
    """A kernel's readable name: jax_ep's kernels by their function name."""
    for key in ("ll_dispatch", "ll_combine", "dispatch_", "combine_", "layout"):
        i = name.find(key)
        if i >= 0:
            return name[i:].split("E")[0].split("I")[0][:28]
    return name[:28]


def summarize(kernels, starts):
    """Per call, over the middle calls: GPU cycle, busy and idle time, each kernel's share."""
    middle = range(len(starts) // 10, len(starts) * 9 // 10 - 1) if len(starts) > 10 \
        else range(len(starts) - 1)
    cycles, busy, per_name = [], [], {}
    for c in middle:
        events = kernels[starts[c]:starts[c + 1]]
        cycles.append((kernels[starts[c + 1]][0] - kernels[starts[c]][0]) / 1e3)
        busy.append(sum(e[1] for e in events) / 1e3)
        for e in events:
            per_name.setdefault(short(e[2]), []).append(e[1] / 1e3)
    n = len(cycles)
    print(f"    over {n} calls: GPU cycle per call median {np.median(cycles):.1f} µs, busy "
          f"{np.median(busy):.1f}, idle {np.median(np.subtract(cycles, busy)):.1f}; "
          "per call: " + ", ".join(f"{k} {sum(v) / n:.1f}" for k, v in per_name.items()))


def show(name, events, host, calls, shown):
    """Prints the middle `shown` calls of the GPU timeline: offset, idle before, duration."""
    kernels = events
    if not kernels:
        print(f"{name}: no GPU events in the trace (CUPTI unavailable?)")
        return
    ours = [i for i, e in enumerate(kernels) if "jax_ep" in e[2] or "ll_" in e[2]]
    print(f"\n=== {name}: {len(kernels)} GPU events, {len(ours)} of them jax_ep kernels")
    if len(ours) < calls:
        for e in kernels[:60]:
            print(f"    {e[1] / 1e3:8.1f} µs  {e[2][:90]}  [{e[3]}]")
        return
    starts = ours[::len(ours) // calls]  # each call's first jax_ep kernel
    summarize(kernels, starts)
    c0 = max(0, calls // 2 - shown // 2)
    first = starts[c0]
    last_i = starts[c0 + shown] if c0 + shown < len(starts) else len(kernels)
    t0 = kernels[first][0]
    prev_end = None
    print("      start    idle    dur   name [stream]")
    for s, d, n, line in kernels[first:last_i]:
        idle = (s - prev_end) / 1e3 if prev_end is not None else 0.0
        print(f"    {(s - t0) / 1e3:7.1f} {idle:7.1f} {d / 1e3:6.1f}   {n[:70]} [{line[:24]}]")
        prev_end = max(prev_end or 0, s + d)
    # host side: when the thunks of the same stretch were launched
    window = [h for h in host if t0 - 50_000 <= h[0] <= prev_end and h[1] < 5_000_000]
    names = {}
    for _s, d, n, _line in window:
        key = n.split(":")[0][:60]
        names.setdefault(key, []).append(d / 1e3)
    print("    host events in that window (name: count, median µs):")
    for key, ds in sorted(names.items(), key=lambda kv: -len(kv[1]))[:14]:
        print(f"      {key}: {len(ds)}, {float(np.median(ds)):.1f}")


def main():
    args = parse_args()
    if "JAX_EP_RANK" in os.environ:
        from jax_ep import launch

        launch.init_distributed()
    from jax_ep import runtime

    R, H, K, E = jax.device_count(), 7168, 8, 256
    T_ll, T = 128, 4096
    runtime.initialize(low_latency_bytes=jax_ep.low_latency_buffer_size_hint(T_ll, H, E, K, R))
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    shard = NamedSharding(mesh, P(AXIS))
    smap = partial(jax.shard_map, mesh=mesh, out_specs=P(AXIS), check_vma=False)
    rng = np.random.default_rng(0)

    def inputs(T):
        idx = np.argsort(-rng.standard_normal((R * T, E)), axis=-1)[:, :K].astype(np.int32)
        x = put(rng.standard_normal((R * T, H)).astype(jnp.bfloat16), shard)
        w = put(rng.random((R * T, K)).astype(np.float32), shard)
        return x, put(idx, shard), w, idx

    ll = dict(num_experts=E, max_tokens_per_rank=T_ll, axis_name=AXIS)

    def ll_fp8(x, idx, w):
        return jax_ep.low_latency_dispatch(x, idx, use_fp8=True, **ll).x_scales[0, 0, 0]

    def ll_dc(x, idx, w):
        o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, **ll)
        return jax_ep.low_latency_combine(o.x, w, o.handle)[0, 0]

    weight = put(rng.standard_normal((R * H, H)).astype(jnp.bfloat16) / np.sqrt(H), shard)

    def matmul(x, idx, weight):  # weight: this rank's [H, H] block
        return jnp.sum(jnp.dot(x, weight, preferred_element_type=jnp.float32))

    def ll_split(x, idx, weight):  # send, an independent matmul, receive (as in bench_low_latency)
        pending = jax_ep.low_latency_dispatch_send(x, idx, use_fp8=True, **ll)
        x_after, _ = jax.lax.optimization_barrier((x, pending))
        s = matmul(x_after, idx, weight)
        return jax_ep.low_latency_dispatch_receive(pending).x_scales[0, 0, 0] + s

    big = inputs(T)
    capacity = int(((big[3] // (E // R))[..., None] == np.arange(R)).any(1).sum(0).max())

    def push(x, idx, w, fp8=False):
        xin = jax_ep.quantize_fp8(x) if fp8 else x
        out = jax_ep.dispatch(xin, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity)
        return out.num_received.astype(jnp.float32)

    small = inputs(T_ll)
    with_weight = (small[0], small[1], weight)
    bodies = {"ll_fp8": (ll_fp8, small[:3]), "ll_dc": (ll_dc, small[:3]),
              "ll_split": (ll_split, with_weight), "matmul": (matmul, with_weight),
              "push": (push, big[:3]), "push_fp8": (partial(push, fp8=True), big[:3])}
    for name in args.rows.split(","):
        body, (x, idx, w) = bodies[name]
        f = jax.jit(smap(looped(body, args.calls, 0), in_specs=(P(AXIS),) * 3))
        wall = seconds_per_call(f, x, idx, w, calls=args.calls, repeats=5)
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            jax.block_until_ready(f(x, idx, w))
            jax.profiler.stop_trace()
            events, host = gpu_events(d)
        if jax.process_index() == 0:
            print(f"\n{name}: {wall * 1e6:.1f} µs per call by the wall clock (no trace)")
            show(name, events, host, args.calls, args.show)


if __name__ == "__main__":
    main()
