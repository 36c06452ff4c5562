"""What the GPU runs between chained jax_ep calls: a JAX profiler (CUPTI) trace of a few
chained calls: per call, the time in jax_ep's kernels, in the program's other GPU work and
idle; then a stretch of rank 0's GPU timeline (every kernel, memset and copy).

    python -m jax_ep.launch -n 2 benchmarks/trace_calls.py [--rows ll_fp8,dispatch]

Rows `dispatch_beside` and `combine_beside` run the dispatch (or the combine of one dispatch
done before) with ``jax_ep.Config(stream=1)`` and an independent matmul on the program's
stream, as bench_intranode's rows do; their timelines name each activity's stream, so they
show whether the matmul ran beside the call, and the compiled schedule shows where XLA put
the call's start and done among the program's work.

Nsight Systems cannot write reports on the device machines; the profiler built into jaxlib
can (benchmarks/timing.py: gpu_events).
"""

from __future__ import annotations

import argparse
import os
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep

from timing import (
    call_profile,
    enqueue_seconds_per_call,
    gpu_events,
    is_ours,
    kernel_details,
    kernel_name,
    kernel_phases,
    looped,
    print_call_profiles,
    put,
    ring_cycles,
    seconds_per_call,
)

AXIS = "ep"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="ll_fp8,ll_dc,ll_split,matmul,dispatch,dispatch_fp8",
                   help="rows; dispatch* take JAX_EP_DISPATCH's path (fused by default); also "
                        "ll_split_combine, dispatch_beside, combine_beside")
    p.add_argument("--calls", type=int, default=100, help="chained calls in the traced program")
    p.add_argument("--show", type=int, default=2, help="calls printed (from the middle)")
    p.add_argument("--host", default=None, metavar="REGEX",
                   help="also print the host's events whose names match (XLA's thunks, CUDA "
                        "API calls such as 'cu.*Launch|cu.*Event'), in the shown calls' window "
                        "and the 100 µs before it: whether the GPU waited for the host")
    p.add_argument("--ring-calls", type=int, default=15,
                   help="calls of the chain timed by the kernels' own stamps (at most 15: "
                        "the profile ring holds 62 halves of calls)")
    p.add_argument("--phases", action="store_true",
                   help="print every rank's kernel phases (µs) in the stamped chain, call by "
                        "call: entered (from the first), past its wait for peers, done")
    p.add_argument("--kernels", action="store_true",
                   help="print each kernel's grid, block, registers and shared memory (CUPTI's "
                        "launch details): whether its blocks leave room beside another's")
    p.add_argument("--show-schedule", type=int, default=40,
                   help="instructions of the _beside rows' compiled schedule printed")
    return p.parse_args()


def spread(cycles):
    """Mean, p10, median, p90 and max of cycles (µs): a mean above the median means some
    calls ran much longer (a rank waiting for a late peer, a host late to enqueue)."""
    p10, p50, p90 = np.percentile(cycles, [10, 50, 90])
    return (f"mean {cycles.mean():.1f}, p10 {p10:.1f}, median {p50:.1f}, p90 {p90:.1f}, "
            f"max {cycles.max():.1f} µs")


def print_gemm_cycles(events):
    """The spread of the cycle over the whole traced chain, from one GEMM's start to the next
    (the rows with a matmul)."""
    starts = [s for s, _, n, *_ in events if "gemm" in n.lower()]
    if len(starts) >= 3:
        cycles = np.diff(starts) / 1e3
        print(f"  GEMM to GEMM, {len(cycles)} cycles: {spread(cycles)}")


def show(name, events, calls, shown, host=()):
    """Prints the per-call profile, then `shown` calls from the middle of the GPU timeline:
    start, idle before, duration, name of every activity; `host`: host events to print among
    them (idle column blank)."""
    ours = [i for i, e in enumerate(events) if is_ours(e[2])]
    if not ours and events:  # work of XLA's own: a stretch from the middle of the timeline
        print(f"\n=== {name}: no jax_ep kernel among {len(events)} GPU activities")
        per_call = max(1, len(events) // calls)
        start = (calls // 2) * per_call
        t0 = prev_end = events[start][0]
        for s, d, n, *stream in events[start:start + shown * per_call]:
            where = f"   [{stream[0]}]" if stream else ""
            print(f"    {(s - t0) / 1e3:7.1f} {(s - prev_end) / 1e3:7.1f} {d / 1e3:6.1f}   "
                  f"{kernel_name(n)}{where}")
            prev_end = max(prev_end, s + d)
        return
    print(f"\n=== {name}: {len(events)} GPU activities, {len(ours)} of them jax_ep kernels")
    if not ours or len(ours) % calls:
        for _, d, n, *_ in events[:60]:
            print(f"    {d / 1e3:8.1f} µs  {n[:90]}")
        return
    print_call_profiles([(name, call_profile(events, calls))])
    starts = ours[::len(ours) // calls] + [len(events)]  # each call's first jax_ep kernel
    c0 = max(0, calls // 2 - shown // 2)
    window = events[starts[c0]:starts[min(c0 + shown, calls)]]
    t0, prev_end = window[0][0], window[0][0]
    t1 = window[-1][0] + window[-1][1]
    merged = sorted([(e, False) for e in window] +
                    [(e, True) for e in host if t0 - 100_000 <= e[0] <= t1])
    if host and not any(on_host for _, on_host in merged):
        print(f"    no host event in the window ({t0}..{t1} ns); the host's run "
              f"{host[0][0]}..{host[-1][0]} ns")
    print("      start    idle    dur   name" + ("   [stream]" if len(window[0]) > 3 else ""))
    for (s, d, n, *stream), on_host in merged:
        where = f"   [{stream[0]}]" if stream else ""
        if on_host:
            print(f"    {(s - t0) / 1e3:7.1f}         {d / 1e3:6.1f}   {n[:60]}{where}")
            continue
        print(f"    {(s - t0) / 1e3:7.1f} {(s - prev_end) / 1e3:7.1f} {d / 1e3:6.1f}   "
              f"{kernel_name(n)}{where}")
        prev_end = max(prev_end, s + d)


def print_schedule(f, operands, limit):
    """The order XLA's scheduler gave the program's work: the entry computation's async
    starts and dones, custom calls and GEMMs, as the compiled program lists them. Work on the
    program's stream overlaps a call on another stream only between its start and its done."""
    text = f.lower(*operands).compile().as_text()
    entry = text[text.index("\nENTRY"):].splitlines()[1:]
    wanted = re.compile(r"-start|-done|custom-call|gemm|cublas|dot\(")
    shown = [line.strip() for line in entry if wanted.search(line)][:limit]
    print(f"\n  schedule (the entry's first {len(shown)} starts, dones, custom calls, GEMMs):")
    for line in shown:
        name, _, rest = line.partition(" = ")
        op = re.search(r"\b([a-z][a-z-]*)\(", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        print(f"    {name[:60]:60s} {op.group(1) if op else ''} "
              f"{target.group(1) if target else ''}")


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
        return jax_ep.low_latency_dispatch(x, idx, use_fp8=True, **ll).recv_count

    def ll_dc(x, idx, w):
        o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, **ll)
        return jax_ep.low_latency_combine(o.x, w, o.handle)

    # the split rows' matmul as bench_low_latency's (float32: a TF32 GEMM), the _beside rows'
    # as bench_intranode's (bfloat16)
    scaled = rng.standard_normal((R * H, H)).astype(jnp.bfloat16) / np.sqrt(H)
    weight = put(scaled.astype(np.float32), shard)
    weight_bf16 = put(scaled.astype(jnp.bfloat16), shard)

    def matmul(x, idx, weight):  # weight: this rank's [H, H] block
        return jnp.sum(jnp.dot(x, weight, preferred_element_type=jnp.float32))

    def ll_split(x, idx, weight):  # send, an independent matmul, receive (as in bench_low_latency)
        pending = jax_ep.low_latency_dispatch_send(x, idx, use_fp8=True, **ll)
        x_after, pending = jax.lax.optimization_barrier((x, pending))
        s = matmul(x_after, idx, weight)
        s, pending = jax.lax.optimization_barrier((s, pending))
        return jax_ep.low_latency_dispatch_receive(pending).recv_count, s

    big = inputs(T)
    capacity = int(((big[3] // (E // R))[..., None] == np.arange(R)).any(1).sum(0).max())

    def dispatch(x, idx, w, fp8=False):
        xin = jax_ep.quantize_fp8(x) if fp8 else x
        out = jax_ep.dispatch(xin, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity)
        return out.num_received

    side = jax_ep.Config(stream=1)

    def beside(xm, weight):  # independent work: [1024, H] @ [H, H] on the program's stream
        return jnp.sum(jnp.dot(xm, weight, preferred_element_type=jnp.float32))

    def dispatch_beside(x, idx, w, xm, weight):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                              config=side)
        return out.num_received, beside(xm, weight)

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),) * 3)
    def dispatched(x, idx, w):  # the combine's operands, dispatched once outside the timing
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                              config=side)
        return out.x, jnp.ones((1, capacity), jnp.float32), jax.tree.map(
            lambda a: a[None], out.handle)

    def combine_beside(y, row_weights, handle, xm, weight):  # as bench_intranode's row
        back = jax_ep.combine(y, jax.tree.map(lambda a: a[0], handle),
                              weights=row_weights[0], config=side)
        return back, beside(xm, weight)

    xm = jax.jit(smap(lambda x: x[:1024], in_specs=P(AXIS)))(big[0])
    small = inputs(T_ll)
    with_weight = (small[0], small[1], weight)
    bodies = {"ll_fp8": (ll_fp8, small[:3]), "ll_dc": (ll_dc, small[:3]),
              "ll_split": (ll_split, with_weight), "matmul": (matmul, with_weight),
              "dispatch": (dispatch, big[:3]),
              "dispatch_fp8": (partial(dispatch, fp8=True), big[:3]),
              "dispatch_beside": (dispatch_beside, big[:3] + (xm, weight_bf16))}
    if "ll_split_combine" in args.rows.split(","):  # one dispatch's handle, reused
        from jax_ep._types import LowLatencyConfig, LowLatencyHandle

        ll_config = LowLatencyConfig(num_experts=E, num_ranks=R, num_tokens=T_ll, hidden=H,
                                     num_topk=K, max_tokens_per_rank=T_ll, use_fp8=False,
                                     axis_name=AXIS, backend="auto")

        @jax.jit
        @partial(smap, in_specs=(P(AXIS),) * 2)
        def handle_arrays(x, idx):
            o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, **ll)
            h = o.handle
            return (jnp.where((h.src_rank >= 0)[..., None], o.x, 0), h.topk_idx, h.send_slot,
                    h.src_rank, h.src_token, h.src_k, h.recv_count, h.pair_row)

        def ll_split_combine(x, y, w, weight, *h):  # as bench_low_latency's combine split row
            handle = LowLatencyHandle(*h, config=ll_config)
            pending = jax_ep.low_latency_combine_send(y, w, handle)
            x_after, pending = jax.lax.optimization_barrier((x, pending))
            s = matmul(x_after, None, weight)
            s, pending = jax.lax.optimization_barrier((s, pending))
            return jax_ep.low_latency_combine_receive(pending, handle), s

        arrays = handle_arrays(small[0], small[1])
        bodies["ll_split_combine"] = (ll_split_combine,
                                      (small[0], arrays[0], small[2], weight) + arrays[1:])
    if "combine_beside" in args.rows.split(","):
        bodies["combine_beside"] = (combine_beside,
                                    dispatched(*big[:3]) + (xm, weight_bf16))
    for name in args.rows.split(","):
        body, operands = bodies[name]
        # the program returns a row of the gates (w) for the side-stream rows, as
        # bench_intranode's do
        chained = {"dispatch_beside": 2, "combine_beside": 1}.get(name, 0)
        f = jax.jit(smap(looped(body, args.calls, chained),
                         in_specs=(P(AXIS),) * len(operands)))
        wall = seconds_per_call(f, *operands, calls=args.calls, repeats=5)
        enqueue = enqueue_seconds_per_call(f, *operands, calls=args.calls, repeats=5)
        ring_chain = jax.jit(smap(looped(body, args.ring_calls, chained),
                                  in_specs=(P(AXIS),) * len(operands)))
        cycles = ring_cycles(ring_chain, *operands)
        if args.phases:  # every rank's, call by call
            for kernel, (enter, waited, _, last, _) in kernel_phases(ring_chain, *operands):
                print(f"  {name} phases, rank {jax.process_index()}: {kernel} entered "
                      f"{enter:8.1f}, waited {waited - enter:6.1f}, done {last - enter:6.1f}")
        events = gpu_events(f, *operands,
                            streams=name.endswith("_beside") or
                            name in ("ll_split", "ll_split_combine", "matmul"),
                            host=args.host)
        events, host = events if args.host else (events, [])
        if jax.process_index() == 0:
            if os.environ.get("TRACE_HLO"):
                text = f.lower(*operands).compile().as_text()
                print(f"  command buffers in the program: {text.count('command_buffer')}")
                with open(f"{os.environ['TRACE_HLO']}_{name}.txt", "w") as fh:
                    fh.write(text)
            print(f"\n{name}: {wall * 1e6:.1f} µs per call by the wall clock (no trace), "
                  f"{enqueue * 1e6:.1f} µs per call to enqueue it (the host's share)")
            show(name, events, args.calls, args.show, host)
            print_gemm_cycles(events)
            if len(cycles) > 2:
                cycles = cycles[1:]  # the first carries the ranks' skew at the start
                print(f"  the kernels' own stamps, no profiler, {len(cycles)} cycles of a chain "
                      f"of {args.ring_calls}: {spread(cycles)}")
            if name.endswith("_beside"):
                print_schedule(f, operands, args.show_schedule)
        if args.kernels:  # a trace of its own, on every rank (the profiler is per process)
            details = kernel_details(f, *operands)
            if jax.process_index() == 0:
                for kernel, text in sorted(details.items()):
                    print(f"  {kernel[:48]:48s} {text}")


if __name__ == "__main__":
    main()
