"""One MoE layer of a decode step (forward only), its expert parallelism done several ways.

Per layer: router (float32, top-k softmax gates) -> expert parallelism -> SwiGLU experts on
grouped rows -> back to the tokens, weighted by the gates, added to x; ``--layers`` of them
chained in one jitted program (the same weights each time: every layer reads them again, as
the step's layers would read their own), timed per layer. The experts of every way run the
same grouped GEMMs (``experts.swiglu_mlp``: on CUDA jax_ep's ``impl="cuda"`` kernel for few
rows per group, elsewhere ``"auto"``), so the ways differ in their communication and its
packing only. The ways:

  l  ``jax_ep.moe.decode_layer``: ``low_latency_dispatch(layout="records")`` (FP8 on the
     wire), the experts reading the records by index, ``low_latency_combine``
  m  l with BF16 on the wire (``use_fp8=False``)
  a  jax_ep's normal mode: ``dispatch(layout="expert_major")`` -> experts -> ``combine``
  c  ``jax.lax.ragged_all_to_all`` of the (token, k) rows sorted by expert, as MaxText's
     layer does (one process only: XLA refuses it across processes)
  d  ``jax.lax.all_to_all`` of per-destination buffers of fixed capacity (a token once per
     rank), a local sort by expert, and back

The ways' layers and packing are ``bench_moe_layer.py``'s (c and d); every way's output is
compared with way d's (FP8 ones within FP8's rounding).

Run:

    python -m jax_ep.launch -n 2 benchmarks/bench_decode_layer.py          # 2 GPUs: l, m, a, d
    python benchmarks/bench_decode_layer.py --ways c,d                    # 1 process, all GPUs
    JAX_PLATFORMS=cpu python benchmarks/bench_decode_layer.py --tokens 8 --hidden 256 \\
        --ffn 128 --experts 16 --topk 4                                   # CPU, 4 fake devices
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

if __name__ == "__main__" and "JAX_EP_RANK" not in os.environ:
    _cpu = argparse.ArgumentParser(add_help=False)
    _cpu.add_argument("--cpu-devices", type=int, default=4)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_cpu.parse_known_args()[0].cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe_layer as training  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import experts as ep_experts  # noqa: E402
from jax_ep import moe as ep_moe  # noqa: E402

AXIS = training.AXIS
WAYS = {
    "l": "jax_ep decode_layer (low latency, records, FP8)",
    "m": "jax_ep decode_layer (low latency, records, BF16)",
    "a": "jax_ep dispatch / combine (expert_major)",
    "c": "ragged_all_to_all + local sort (MaxText)",
    "d": "all_to_all, capacity-padded",
}
FP8_WAYS = ("l",)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="layers chained in one program")
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="a, c, d: received rows per rank = factor x their mean under uniform "
                        "routing (clipped to the worst case); l and m never drop")
    p.add_argument("--ways", default=None,
                   help="comma-separated subset of l,m,a,c,d; default l,m,a,d (under the "
                        "launcher) or c,d (one process over several GPUs) or all (CPU)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=6.0)
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"])
    p.add_argument("--cpu-devices", type=int, default=4, help="fake host devices on CPU")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_layers(s: training.Setup, way, mesh, layers, impl):
    """jit(params, x) -> (x after `layers` layers, pairs dropped on all ranks)."""
    specs = training.param_specs(0, s.axis)

    def expert_fn(w, rows, group_sizes):
        return ep_experts.swiglu_mlp(rows, *w, group_sizes, impl=impl)

    def one(params, x):
        w = [params[n].astype(x.dtype) for n in ("w_gate", "w_up", "w_down")]
        if way in ("l", "m"):
            p = ep_moe.MoEParams(params["router"], *w)
            y, aux = ep_moe.decode_layer(x, p, top_k=s.topk, axis_name=s.axis,
                                         use_fp8=way == "l",
                                         backend=s.backend, gemm_impl=impl)
            return y, jax.lax.psum(aux.num_dropped, s.axis)
        topk_idx, gates = ep_moe.route(x, params["router"], s.topk)
        y, dropped = training.ROUTED[way](s, x, topk_idx, gates, partial(expert_fn, w))
        return y, jax.lax.psum(dropped, s.axis)

    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(s.axis)), out_specs=(P(s.axis), P()))
    def run(params, x):
        dropped = jnp.zeros((), jnp.int32)
        for _ in range(layers):
            y, d = one(params, x)
            x, dropped = x + y, dropped + d.astype(jnp.int32)
        return x, dropped

    return jax.jit(run)


def main(argv=None):
    args = parse_args(argv)
    launched = "JAX_EP_RANK" in os.environ
    if launched:
        from jax_ep import launch, runtime  # noqa: F401  (runtime: before JAX's GPU client
        # starts, so that XLA leaves room for the NVSHMEM buffer)

        launch.init_distributed()
    platform = jax.default_backend()
    R = jax.device_count()
    backend = training.jax_ep_backend(args.backend)
    if args.backend == "cuda" and backend != "cuda":
        sys.exit("--backend cuda needs one process per GPU (jax_ep.launch) and the extension")
    default = ("l,m,a,c,d" if platform == "cpu" else
               "c,d" if jax.process_count() == 1 and R > 1 else "l,m,a,d")
    ways = [w for w in (args.ways or default).split(",") if w]
    for w in ways:
        if w not in WAYS:
            sys.exit(f"unknown way {w!r}: choose from {', '.join(WAYS)}")
    if "c" in ways and jax.process_count() > 1:
        sys.exit("way c (ragged_all_to_all) runs in one process: python "
                 "benchmarks/bench_decode_layer.py --ways c,d")
    if args.experts % R:
        sys.exit(f"--experts={args.experts} must be divisible by the {R} devices")
    s = training.Setup(ranks=R, tokens=args.tokens, hidden=args.hidden, ffn=args.ffn,
                       experts=args.experts, topk=args.topk,
                       capacity_factor=args.capacity_factor, alignment=1, backend=backend,
                       ragged="emulated" if platform == "cpu" else "native",
                       gemm_impl="grouped")
    if backend == "cuda":
        from jax_ep import _cuda, runtime

        ll = jax_ep.low_latency_buffer_size_hint(s.tokens, s.hidden, s.experts, s.topk, R)
        normal = _cuda.buffer_size_hint(s.tokens, s.hidden, s.topk, s.experts, R,
                                        capacity=s.rows_a, dtype=jnp.bfloat16,
                                        layout="expert_major", alignment=1)
        runtime.initialize(buffer_bytes=max(normal, runtime.default_buffer_bytes()),
                           low_latency_bytes=ll)
    # the same expert GEMMs for every way, in one process over all GPUs too (a local kernel)
    impl = "cuda" if platform == "gpu" and ep_experts._native_gemm_available() else "auto"
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    mesh = jax.make_mesh((R,), (AXIS,), devices=jax.devices(),
                         axis_types=(jax.sharding.AxisType.Auto,))
    say(f"{R}x {jax.devices()[0].device_kind} ({platform}), {jax.process_count()} process(es), "
        f"jax {jax.__version__}, jax_ep backend {backend}, expert GEMMs impl={impl}")
    say(f"T={s.tokens}/rank H={s.hidden} F={s.ffn} E={s.experts} (L={s.local_experts}/rank) "
        f"top-{s.topk}, bfloat16, {args.layers} layers a program; capacity factor "
        f"{s.capacity_factor}: a {s.rows_a} rows, c/d sorted pairs {s.pairs}, d {s.slots_d} "
        f"rows per (source, destination)")
    key = jax.random.key(args.seed)
    params = training.init_params(key, s, jnp.bfloat16, mesh)
    x = jax.jit(lambda k: jax.random.normal(k, (R * s.tokens, s.hidden), jnp.bfloat16),
                out_shardings=NamedSharding(mesh, P(AXIS)))(jax.random.fold_in(key, 100))

    results, outputs = [], {}
    for way in ways:
        name = f"({way}) {WAYS[way]}"
        try:
            t0 = time.perf_counter()
            f = make_layers(s, way, mesh, args.layers, impl).lower(params, x).compile()
            compile_s = time.perf_counter() - t0
            t, out = training.time_program(f, (params, x), args.steps, args.warmup,
                                           args.budget_s)
            outputs[way] = np.asarray(jax.experimental.multihost_utils.process_allgather(
                out[0], tiled=True), np.float32) if jax.process_count() > 1 else \
                np.asarray(out[0], np.float32)
            results.append((way, name, t * 1e6 / args.layers, int(out[1]), compile_s))
            say(f"{name}: {t * 1e6 / args.layers:.1f} µs per layer, dropped {int(out[1])}, "
                f"compiled in {compile_s:.0f} s")
        except Exception as e:  # one way failing must not hide the others
            results.append((way, name, None, None, None))
            say(f"{name} FAILED: {type(e).__name__}: {str(e)[:400]}")
    if not lead:
        return
    ref = outputs.get("d")
    base = next((r[2] for r in results if r[0] == "d" and r[2] is not None), None)
    print(f"\nMoE decode layer, forward, {R} ranks x {s.tokens} tokens, {args.layers} layers a "
          "program")
    print("| way | µs per layer | vs (d) | dropped | max |x - x_d| / max |x_d| |")
    print("|---|---:|---:|---:|---:|")
    for way, name, us, dropped, _ in results:
        if us is None:
            print(f"| {name} | failed | | | |")
            continue
        diff = "-"
        if ref is not None and way in outputs:
            diff = f"{np.abs(outputs[way] - ref).max() / max(np.abs(ref).max(), 1e-9):.2g}"
        vs = f"{us / base:.2f}" if base else "-"
        print(f"| {name} | {us:.1f} | {vs} | {dropped} | {diff} |")
    print("µs per layer: median wall time of the program (each blocked on) / layers; dropped: "
          "pairs or rows over all ranks and layers; the last column: the final x against way "
          "d's (l: its rows cross in FP8)")


if __name__ == "__main__":
    main()
