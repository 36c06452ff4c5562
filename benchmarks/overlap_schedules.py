"""Which arrangement lets a jax_ep call and independent work overlap inside one jitted program:
the call on a stream of its own (``Config(stream=1)``), the work on one (``jax_ep.on_stream``),
or both. Per arrangement: µs per call in a chain, and XLA's schedule of the program's first
starts, dones, custom calls and GEMMs (work on the program's stream overlaps a call on another
stream only between that call's start and its done).

    python -m jax_ep.launch -n 2 benchmarks/overlap_schedules.py [--calls 50]

The work (``--work``) is an independent [1024, H] @ [H, H] matmul, as bench_intranode's rows
(``matmul``), or expert GEMMs of the MoE layer's shapes on 3840 rows: 12 experts' [320, H] @
[H, 2048] blocks as ``experts.swiglu_mlp_padded``'s batched einsum (``batched``), or the same
rows as one grouped GEMM through ``experts.grouped_matmul`` (``grouped``: its Pallas kernel on
a Hopper GPU). ``--gemm-sms N`` runs ``batched`` through ``experts.batched_matmul`` (cuBLASLt)
sized for N SMs (0: every SM) instead of XLA's einsum. ``--kernels`` prints each kernel's
grid, registers and shared memory in the work alone (whether it holds every SM). The
combine's operands come from one dispatch done before the timing. DeepSeek-V3 shapes (4096
tokens per rank, H 7168, top-8 of 256).
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from trace_calls import print_schedule

import jax_ep

from timing import ep_mesh, kernel_details, looped, put, random_routing, seconds_per_call

AXIS = "ep"
ARRANGEMENTS = {  # name: (the jax_ep call's stream, the work's stream); 0: the program's
    "call on stream 1": (1, 0),
    "work on stream 1": (0, 1),
    "call on 1, work on 2": (1, 2),
    "one stream": (0, 0),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=50, help="chained calls per program")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--show-schedule", type=int, default=12)
    p.add_argument("--work", default="matmul", choices=["matmul", "batched", "grouped"])
    p.add_argument("--gemm-sms", type=int, default=None,
                   help="batched: jax_ep's cuBLASLt GEMM sized for this many SMs (0: all)")
    p.add_argument("--kernels", action="store_true",
                   help="print the kernels of the work alone (CUPTI's launch details)")
    args = p.parse_args()
    if "JAX_EP_RANK" in os.environ:
        from jax_ep import launch

        launch.init_distributed()
    from jax_ep import runtime

    R, K, E, T, H = jax.device_count(), 8, 256, args.tokens, args.hidden
    if jax.default_backend() == "gpu":
        runtime.initialize()
    _, shard, smap = ep_mesh(R, AXIS)
    rng = np.random.default_rng(0)
    idx_np, x, w, idx = random_routing(rng, R, T, H, E, K, shard)
    capacity = int(((idx_np // (E // R))[..., None] == np.arange(R)).any(1).sum(0).max())
    # xm passes the chain's barrier: no call is hoisted or merged.
    if args.work == "matmul":
        M, shape = min(1024, T), (R * H, H)

        def work(xm, weight):
            return jnp.sum(jnp.dot(xm, weight, preferred_element_type=jnp.float32))
    else:  # 12 experts x 320 rows: the layer's expert blocks at a capacity factor of 1.25
        experts_here, block, ffn = 12, 320, 2048
        M, shape = min(experts_here * block, T), (R * experts_here, H, ffn)
        sizes = np.full(experts_here, M // experts_here, np.int32)
        sizes[-1] += M - sizes.sum()

        def work(xm, weight):
            if args.work == "batched":
                blocks = xm[:experts_here * (M // experts_here)].reshape(experts_here, -1, H)
                if args.gemm_sms is None:
                    out = jnp.einsum("lch,lhf->lcf", blocks, weight)
                else:
                    out = jax_ep.experts.batched_matmul(blocks, weight, sm_count=args.gemm_sms,
                                                        backend="cuda")
            else:
                out = jax_ep.experts.grouped_matmul(xm, weight, jnp.asarray(sizes))
            return jnp.sum(out.astype(jnp.float32))
    weight = put((rng.standard_normal(shape) / np.sqrt(H)).astype(jnp.bfloat16), shard)

    xm = jax.jit(smap(lambda x: x[:M], in_specs=P(AXIS)))(x)

    def on(n, fn):
        return jax_ep.on_stream(fn, n) if n else fn

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),) * 3)
    def dispatched(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity)
        return out.x, jnp.ones((1, capacity), jnp.float32), jax.tree.map(
            lambda a: a[None], out.handle)

    combine_operands = dispatched(x, idx, w)

    def combine(call_stream, work_stream):
        def body(y, row_weights, handle, xm, weight):
            back = jax_ep.combine(y, jax.tree.map(lambda a: a[0], handle),
                                  weights=row_weights[0],
                                  config=jax_ep.Config(stream=call_stream))
            return back, on(work_stream, work)(xm, weight) if work_stream >= 0 else ()

        return body, combine_operands + (xm, weight), 1

    def dispatch(call_stream, work_stream):
        def body(x, idx, w, xm, weight):
            out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                                  config=jax_ep.Config(stream=call_stream))
            return out.num_received, on(work_stream, work)(xm, weight) if work_stream >= 0 else ()

        return body, (x, idx, w, xm, weight), 2

    def run(name, body, operands, chained, schedule=True):
        f = jax.jit(smap(looped(body, args.calls, chained), in_specs=(P(AXIS),) * len(operands)))
        t = seconds_per_call(f, *operands, calls=args.calls, repeats=5)
        if jax.process_index() == 0:
            print(f"\n{name}: {t * 1e6:.1f} µs per call", flush=True)
            if schedule and args.show_schedule > 0:
                print_schedule(f, operands, args.show_schedule)
        return f

    alone = run(f"{args.work} alone", work, (xm, weight), 0, schedule=False)
    if args.kernels:
        details = kernel_details(alone, xm, weight)
        if jax.process_index() == 0:
            for name, line in sorted(details.items()):
                print(f"  {name:48s} {line}")
    for kind, make in (("combine", combine), ("dispatch", dispatch)):
        run(f"{kind} alone", *make(0, -1), schedule=False)
        for name, (call_stream, work_stream) in ARRANGEMENTS.items():
            run(f"{kind} + {args.work}, {name}", *make(call_stream, work_stream))


if __name__ == "__main__":
    main()
