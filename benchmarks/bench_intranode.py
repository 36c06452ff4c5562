"""Intranode normal-mode benchmark: jax_ep layout / dispatch / combine next to what JAX offers.

    python -m jax_ep.launch -n 2 benchmarks/bench_intranode.py            # one process per GPU
    python benchmarks/bench_intranode.py --tokens 256 --hidden 512         # CPU, reference only

Every row is the time of one call as XLA runs it: one jitted program of ``--iters`` unrolled calls,
each depending on the previous one through a zero-weighted scalar (so nothing is hoisted or
overlapped), divided by ``--iters``; median of ``--repeats``. Bandwidth is DeepEP's *logical*
figure: bytes of the rank-deduplicated tokens a rank receives (its own ones included) over
that time. Baselines: ``jax.lax.ragged_all_to_all`` (deduplicated rows) and a capacity-padded
``jax.lax.all_to_all``. XLA refuses ragged_all_to_all across processes ("fallback to NCCL is
not allowed"), so under the launcher that row comes from ``--baselines-only``, a second run
in one process over all local GPUs with the same routing. ``--independent-rows``: a matmul
that needs nothing from the dispatch or the combine, timed alone and in the same call as the
default dispatch and combine, so that any overlap XLA makes of them shows; on a GPU also with
the dispatch and the combine on a second stream (``jax_ep.Config(stream=1)``), and with the
matmul on one (``jax_ep.on_stream``).
"""

from __future__ import annotations

import argparse
import os
from functools import partial


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--routing", default="random", choices=["random", "zipf", "hot"])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5,
                   help="also time the chain run this many times in one program (fori_loop): "
                        "the steady state of a long run of calls; 1: off")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--modes", default="pull,fused,copy,slots,slots-fused",
                   help="dispatch modes to time (JAX_EP_DISPATCH values; slots: the "
                   "source_slots layout by its copy engines, slots-fused: by the SMs, either "
                   "with its combine in every --combine-modes), comma-separated")
    p.add_argument("--combine-modes", default="push,pull,copy",
                   help="combine modes to time (JAX_EP_COMBINE values), comma-separated")
    p.add_argument("--gemm-sms", type=int, default=None,
                   help="the independent matmul through jax_ep.experts.batched_matmul sized "
                        "for this many SMs (0: every SM); default XLA's dot")
    p.add_argument("--independent-rows", type=int, default=1024,
                   help="rows M of an independent matmul ([M, H] @ [H, H]) timed alone and in "
                        "the same call as the default dispatch: what XLA overlaps; 0: off")
    p.add_argument("--baselines-only", action="store_true",
                   help="only the JAX baselines, in one process over all local GPUs")
    p.add_argument("--cpu-devices", type=int, default=4, help="fake devices for CPU runs")
    p.add_argument("--node-size", type=int, default=None,
                   help="virtual nodes of this many ranks (runtime.initialize(node_size=)): "
                        "the dispatch and combine across nodes")
    p.add_argument("--profile", action="store_true",
                   help="also print each kernel's phases (entered / done waiting / finished) "
                        "for one call of every jax_ep row (CUDA backend)")
    return p.parse_args()


args = parse_args()
if "JAX_EP_RANK" not in os.environ and os.environ.get("JAX_PLATFORMS", "") == "cpu":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

from timing import (  # noqa: E402
    build_line,
    call_profile,
    copy_host_breakdown,
    gpu_events,
    host_times_reset,
    host_us_per_call,
    is_ours,
    jax_baselines,
    looped,
    print_call_profiles,
    print_phases,
    profile_body,
    progress,
    put,
    seconds_per_call,
    steady_seconds_per_call,
)

AXIS = "ep"


def routing(R, T, E, K, kind, seed=0):
    """Global [R, T, K] expert ids, distinct per token."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        scores = rng.standard_normal((R, T, E))
    elif kind == "zipf":  # expert popularity ~ 1 / rank^1.2
        popularity = 1.0 / np.arange(1, E + 1) ** 1.2
        scores = np.log(popularity)[None, None] + rng.gumbel(size=(R, T, E))
    else:  # one hot expert that every token picks, the rest random
        scores = rng.standard_normal((R, T, E))
        scores[..., 0] = 1e9
    return np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)


def main():
    if "JAX_EP_RANK" in os.environ:
        from jax_ep import launch

        launch.init_distributed()
    R, T, H, K, E = jax.device_count(), args.tokens, args.hidden, args.topk, args.experts
    L = E // R
    backend = args.backend
    if backend != "reference" and jax.default_backend() == "gpu" and not args.baselines_only:
        from jax_ep import runtime

        if args.node_size is None:
            runtime.initialize()
        else:  # virtual nodes: the hierarchical paths (node exchange by puts, then NVLink)
            need = max(jax_ep.buffer_size_hint(T, H, K, E, R, layout=lay, node_size=args.node_size)
                       for lay in ("rank_major", "expert_major"))
            runtime.initialize(max(need, runtime.default_buffer_bytes()),
                               node_size=args.node_size)
    backend = jax_ep.api._resolve_backend(backend)
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    shard = NamedSharding(mesh, P(AXIS))
    smap = partial(jax.shard_map, mesh=mesh, out_specs=P(AXIS), check_vma=False)

    idx = routing(R, T, E, K, args.routing)
    dest = idx // L
    in_rank = (dest[..., None] == np.arange(R)).any(2)  # [src, T, dst]
    counts = in_rank.sum(1)  # [src, dst]
    recv_tokens = counts.sum(0)  # per destination
    mean_recv = float(recv_tokens.mean())
    rng = np.random.default_rng(1)
    x = put(rng.standard_normal((R * T, H)).astype(jnp.bfloat16), shard)
    w = put(rng.random((R * T, K)).astype(np.float32), shard)
    idx_d = put(idx.reshape(R * T, K), shard)
    bytes_bf16 = mean_recv * H * 2
    bytes_fp8 = mean_recv * (H + H // 128 * 4)
    rows = []
    profiles, call_profiles = [], []
    copy_host = []  # (row, mean host µs per call, its copy-engine host calls by kind)

    def record(name, body, *a, chained=0, nbytes=bytes_bf16, marker=is_ours):
        """Times body; with --profile on a GPU also its kernels' phases (jax_ep's) and the
        per-call GPU time of the kernels `marker` picks (None: none)."""
        try:
            f = jax.jit(smap(looped(body, args.iters, chained), in_specs=(P(AXIS),) * len(a)))
            host_times_reset()
            t = seconds_per_call(f, *a, calls=args.iters, repeats=args.repeats)
            host = host_us_per_call()
            breakdown = copy_host_breakdown()
            if breakdown:
                copy_host.append((name, *breakdown))
            steady = steady_seconds_per_call(
                lambda g: jax.jit(smap(g, in_specs=(P(AXIS),) * len(a))), body, *a,
                calls=args.iters, chained=chained, rounds=args.rounds, repeats=args.repeats)
            gpu = None
            if args.profile and jax.default_backend() == "gpu" and marker is not None:
                if marker is is_ours and backend == "cuda":
                    profiles.append((name, profile_body(body, chained, AXIS, smap, a)))
                gpu = call_profile(gpu_events(f, *a), args.iters, marker)
                call_profiles.append((name, gpu))
            rows.append((name, t * 1e6, nbytes / t / 1e9 if nbytes else float("nan"),
                         steady * 1e6, nbytes / steady / 1e9 if nbytes else float("nan"),
                         gpu["cycle"] if gpu else float("nan"), host))
            progress(name, t * 1e6, steady * 1e6)
        except Exception as e:  # a failing row must not hide the others
            rows.append((name,) + (float("nan"),) * 6)
            if jax.process_index() == 0:
                print(f"{name} FAILED: {type(e).__name__}: {str(e)[:400]}")

    if args.baselines_only:
        jax_baselines(R, H, in_rank, counts, x, shard, record, AXIS)
        report(rows, R, T, H, K, E, mean_recv, bytes_bf16, "JAX baselines only")
        return

    # ------------------------------------------------------------------ jax_ep
    capacity = int(recv_tokens.max())  # tight static capacity: nothing dropped
    em_capacity = int(np.bincount(idx.reshape(-1), minlength=E).reshape(R, L).sum(1).max())

    def layout(idx):
        return jax_ep.get_dispatch_layout(idx, E, axis_name=AXIS, backend=backend)

    def dispatch(x, idx, w, layout="rank_major", cap=capacity, config=None, use_fp8=False):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=cap,
                              layout=layout, backend=backend, config=config, use_fp8=use_fp8)
        return out.num_received  # one of the call's results: no kernel reads it

    def dispatch_for_combine(layout="rank_major", cap=capacity):
        @jax.jit
        @partial(smap, in_specs=(P(AXIS),) * 3)
        def run(x, idx, w):
            out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=cap,
                                  layout=layout, backend=backend)
            return out.x, jnp.ones((1, cap), jnp.float32), jax.tree.map(
                lambda a: a[None], out.handle)

        return run

    def combine(y, row_weights, handle, config=None):
        out = jax_ep.combine(y, jax.tree.map(lambda a: a[0], handle), weights=row_weights[0],
                             config=config)
        return out

    def quantize(x, w, backend=backend):
        return jax_ep.quantize_fp8(x, backend=backend)

    def dispatch_fp8(xq, scales, idx, w, **kw):  # rows quantized beforehand, as a layer's
        return dispatch((xq, scales), idx, w, **kw)  # FP8 GEMM epilogue would leave them

    def quantize_dispatch(x, idx, w):
        return dispatch(jax_ep.quantize_fp8(x), idx, w)

    xq = jax.jit(smap(jax_ep.quantize_fp8, in_specs=P(AXIS)))(x)

    record("jax_ep layout", layout, idx_d, nbytes=0)
    record("jax_ep quantize_fp8 alone (not communication)", quantize, x, w, chained=1, nbytes=0,
           marker=None)
    if backend != "reference":
        record("jax_ep quantize_fp8 by XLA's ops (backend='reference')",
               partial(quantize, backend="reference"), x, w, chained=1, nbytes=0, marker=None)
    modes = args.modes.split(",")
    for mode in modes:  # JAX_EP_DISPATCH, read when the call is traced
        if mode in ("slots", "slots-fused"):  # source_slots: its copy engines, or its SMs
            os.environ["JAX_EP_DISPATCH"] = "fused" if mode == "slots-fused" else "copy"
            slots = partial(dispatch, layout="source_slots", cap=R * T)
            record(f"jax_ep dispatch BF16 source_slots [{mode}]", slots, x, idx_d, w, chained=2)
            record(f"jax_ep dispatch FP8 source_slots [{mode}]",
                   partial(dispatch_fp8, layout="source_slots", cap=R * T), *xq, idx_d, w,
                   chained=3, nbytes=bytes_fp8)
            continue
        os.environ["JAX_EP_DISPATCH"] = mode
        record(f"jax_ep dispatch BF16 [{mode}]", dispatch, x, idx_d, w, chained=2)
        record(f"jax_ep dispatch FP8 [{mode}]", dispatch_fp8, *xq, idx_d, w, chained=3,
               nbytes=bytes_fp8)
        if mode == "fused":  # what a layer holding BF16 rows pays: jax_ep.quantize_fp8 first,
            # or the rows quantised on the way (use_fp8)
            record("jax_ep quantize_fp8 + dispatch FP8 [fused]", quantize_dispatch, x, idx_d,
                   w, chained=2, nbytes=bytes_fp8)
            record("jax_ep dispatch BF16 rows, use_fp8 [fused]",
                   partial(dispatch, use_fp8=True), x, idx_d, w, chained=2, nbytes=bytes_fp8)
        record(f"jax_ep dispatch BF16 expert_major [{mode}]",
               partial(dispatch, layout="expert_major", cap=em_capacity), x, idx_d, w,
               chained=2)
        if mode == "copy":  # a new x every call, as layer after layer: the cached copy graph
            # is updated in place (its host time); the time includes an add over x
            record("jax_ep dispatch BF16, new x every call [copy]",
                   lambda x, idx, w: dispatch(x + w[:1, :1].astype(x.dtype), idx, w),
                   x, idx_d, w, chained=0)
    os.environ.pop("JAX_EP_DISPATCH", None)
    on_gpu = jax.default_backend() == "gpu"
    side = jax_ep.Config(stream=1)  # XLA runs the calls on a stream of their own
    M = min(args.independent_rows, T)
    weight = put((rng.standard_normal((R * H, H)) / np.sqrt(H)).astype(jnp.bfloat16), shard)

    def independent(x, weight):
        # Work that needs nothing from the dispatch or the combine, in the same call (as a
        # layer's next projection beside its tokens' dispatch): whatever overlaps shows as
        # less than the rows alone. x is new to XLA every call (the chain's barrier), so no
        # call's matmul is merged or hoisted.
        if args.gemm_sms is not None:  # jax_ep's GEMM, sized to leave the calls SMs
            return jnp.sum(jax_ep.experts.batched_matmul(
                x[None], weight[None], sm_count=args.gemm_sms,
                preferred_element_type=jnp.float32, backend="cuda"))
        return jnp.sum(jnp.dot(x, weight, preferred_element_type=jnp.float32))

    xm = jax.jit(smap(lambda x: x[:M], in_specs=P(AXIS)))(x)  # the matmul's rows
    if M > 0:
        record("jax.numpy independent matmul alone",
               lambda x, idx, w, xm, weight: independent(xm, weight), x, idx_d, w, xm,
               weight, chained=2, nbytes=0, marker=None)
        record("jax_ep dispatch BF16 + independent matmul, one call",
               lambda x, idx, w, xm, weight: (dispatch(x, idx, w), independent(xm, weight)),
               x, idx_d, w, xm, weight, chained=2, nbytes=0)
        if on_gpu:
            record("jax_ep dispatch BF16 on stream 1 + independent matmul, one call",
                   lambda x, idx, w, xm, weight: (dispatch(x, idx, w, config=side),
                                                  independent(xm, weight)),
                   x, idx_d, w, xm, weight, chained=2, nbytes=0)
            record("jax_ep dispatch BF16 + independent matmul on stream 1, one call",
                   lambda x, idx, w, xm, weight: (dispatch(x, idx, w),
                                                  jax_ep.on_stream(independent)(xm, weight)),
                   x, idx_d, w, xm, weight, chained=2, nbytes=0)
    combine_inputs = dispatch_for_combine()(x, idx_d, w)
    for mode in args.combine_modes.split(","):  # JAX_EP_COMBINE, read when traced
        os.environ["JAX_EP_COMBINE"] = mode
        record(f"jax_ep combine BF16 [{mode}]", combine, *combine_inputs, chained=1)
    os.environ.pop("JAX_EP_COMBINE", None)
    if M > 0:
        def combine_beside(y, row_weights, handle, xm, weight, config=None, work_stream=0):
            beside = jax_ep.on_stream(independent, work_stream) if work_stream else independent
            return combine(y, row_weights, handle, config), beside(xm, weight)

        record("jax_ep combine BF16 + independent matmul, one call", combine_beside,
               *combine_inputs, xm, weight, chained=1, nbytes=0)
        if on_gpu:
            record("jax_ep combine BF16 on stream 1 + independent matmul, one call",
                   partial(combine_beside, config=side), *combine_inputs, xm, weight,
                   chained=1, nbytes=0)
            # XLA's scheduler starts the work's call before the combine: they overlap
            record("jax_ep combine BF16 + independent matmul on stream 1, one call",
                   partial(combine_beside, work_stream=1), *combine_inputs, xm, weight,
                   chained=1, nbytes=0)
    em_inputs = dispatch_for_combine("expert_major", em_capacity)(x, idx_d, w)
    record("jax_ep combine BF16 expert_major [pull]", combine, *em_inputs, chained=1)
    if "slots" in modes or "slots-fused" in modes:
        slots_inputs = dispatch_for_combine("source_slots", R * T)(x, idx_d, w)
        for mode in args.combine_modes.split(","):
            if mode == "push":  # rank_major's path only (source_slots would take its copy)
                continue
            os.environ["JAX_EP_COMBINE"] = mode
            record(f"jax_ep combine BF16 source_slots [{mode}]", combine, *slots_inputs,
                   chained=1)
    os.environ.pop("JAX_EP_COMBINE", None)

    # ------------------------------------------------------------------ baselines
    if not args.skip_baselines:
        jax_baselines(R, H, in_rank, counts, x, shard, record, AXIS)
    report(rows, R, T, H, K, E, mean_recv, bytes_bf16, f"backend={backend}",
           held=jax_ep.runtime.xla_window_holds(x))
    if args.node_size is not None and jax.process_index() == 0:
        # a token crosses to each other node holding one of its experts once (the node
        # exchange), and one partial row per (token, node) comes back
        node = np.arange(R) // args.node_size
        reached = (node[dest][..., None] == np.arange(R // args.node_size)).any(2)  # [s, T, N]
        remote = (reached & (np.arange(R // args.node_size)[None, None, :]
                             != node[:, None, None])).sum() / R
        print(f"virtual nodes of {args.node_size}: {remote / T:.2f} rows per token cross nodes; "
              f"per rank and call {remote * 2 * H / 1e6:.1f} MB BF16 / "
              f"{remote * (H + H // 128 * 4) / 1e6:.1f} MB FP8 dispatched, "
              f"{remote * 2 * H / 1e6:.1f} MB BF16 combined back, plus {8 * K * T / 1e6:.2f} MB "
              "of ids and weights per other node")
    if copy_host and jax.process_index() == 0:
        print("\nHost time of the copy-engine rows per call (µs: the median execution, and each "
              "kind of host call's median times its calls per execution, in brackets; the rest "
              "is validation and kernel launches):")
        for name, host, kinds in copy_host:
            parts = ", ".join(f"{kind} {us:.1f} [{calls:.0f}]" for kind, (calls, us) in
                              kinds.items())
            print(f"  {name}: host {host:.1f} = {parts}, rest "
                  f"{host - sum(us for _, us in kinds.values()):.1f}")
    if profiles and jax.process_index() == 0:
        print_phases(profiles)
        print_call_profiles(call_profiles)


def report(rows, R, T, H, K, E, mean_recv, bytes_bf16, what, held=True):
    if jax.process_index() == 0:
        windows = jax_ep.runtime.xla_windows_open()
        reach = ("no (staged copies)" if not windows else
                 "yes" if held else "yes, but x lies outside them (staged copies)")
        print(f"\n{R}×{jax.devices()[0].device_kind} {what}, {jax.process_count()} process(es), "
              f"T={T}/rank H={H} top-{K} of {E} ({args.routing} routing); mean received "
              f"tokens/rank {mean_recv:.0f} ({bytes_bf16 / 1e6:.1f} MB BF16); "
              f"{args.iters} chained calls per timing; peers reach XLA's arrays directly: "
              f"{reach}")
        print(build_line())
        steady = f"{args.rounds}×{args.iters}"
        print(f"| {'operation':52s} | {'µs':>9s} | {'GB/s logical':>12s} | "
              f"{steady + ' µs':>11s} | {steady + ' GB/s':>12s} | {'GPU µs/call':>11s} | "
              f"{'host µs/call':>12s} |")
        print(f"|{'-' * 54}|{'-' * 11}|{'-' * 14}|{'-' * 13}|{'-' * 14}|{'-' * 13}|{'-' * 14}|")
        for name, us, gbs, s_us, s_gbs, cycle, host in rows:
            print(f"| {name:52s} | {us:9.1f} | {gbs:12.1f} | {s_us:11.1f} | {s_gbs:12.1f} | "
                  f"{cycle:11.1f} | {host:12.1f} |")
        print(f"µs: wall clock of the chained program / calls (its launch included); {steady}: "
              f"the same chain {args.rounds} times in a fori_loop, wall clock / all calls "
              "(--rounds; the launch spread over them); GPU µs/call: the GPU's cycle per call "
              "in a profiler trace of the first program (--profile; details below); host "
              "µs/call: median host time of jax_ep's handlers per call (enqueueing it)")


if __name__ == "__main__":
    main()
