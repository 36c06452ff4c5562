"""Decode with the split low-latency calls: two micro-batches, each one's tokens in flight
while the other's GEMMs run.

CPU (default: 8 fake host devices, reference backend):
    python examples/decode_overlap.py
GPUs (one process per GPU, CUDA kernels; DeepSeek-V3's decode rows, 8 experts a GPU):
    python -m jax_ep.launch -n 2 examples/decode_overlap.py --backend cuda \\
        --tokens 128 --hidden 7168 --ffn 2048 --experts 16 --top-k 8

A layer here is a dense projection (standing in for attention) and a routed MoE FFN whose
tokens travel by ``low_latency_dispatch`` (FP8) and come back by ``low_latency_combine``. Two
micro-batches A and B go through a stack of layers in turn, or interleaved:

    A: dense, send ─────── receive, experts, send ─────── receive
    B:             dense ──────────────────── send ─────── receive, experts, send ── receive

so every send is followed by the other micro-batch's GEMMs and only then by its receive. On
CUDA those GEMMs are ``experts.batched_matmul`` sized by ``low_latency_split_gemm_sms``: XLA's
own GEMMs take one CTA on every SM, and the split kernel would wait for them. With
``--layout expert_major`` the rows arrive packed by local expert and the experts run grouped
GEMMs over the used rows only (``experts.grouped_matmul``; on CUDA ``impl="cuda"``, sized the
same way): the choice where a rank holds many experts, each getting a few rows; with
``--layout records`` each token arrives once and the first GEMM reads the packed rows by the
handle's index (``row_index=handle.record_rows()``). The example
checks that both schedules give the same tokens and prints each one's time per layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU runs only)")
    p.add_argument("--tokens", type=int, default=16, help="tokens per rank per micro-batch")
    p.add_argument("--hidden", type=int, default=256, help="a multiple of 128 (FP8 scales)")
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20, help="timed executions of each schedule")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--layout", default="blocks", choices=["blocks", "expert_major", "records"],
                   help="the dispatch's rows: per-expert blocks through batched GEMMs, "
                        "packed by expert through grouped GEMMs, or each token once, read by "
                        "index by the grouped GEMMs")
    return p.parse_args()


args = parse_args()
launched = "JAX_EP_RANK" in os.environ
if not launched and args.backend != "cuda":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.experts import batched_matmul, grouped_matmul  # noqa: E402

AXIS = "ep"
tie = jax.lax.optimization_barrier  # orders independent work: XLA follows data only


def init_params(key, H, F, E, layers, shardings):
    """bf16 weights made where they live (each device its experts' slices)."""
    def make(key):
        out = []
        for i in range(layers):
            k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, i), 4)
            normal = partial(jax.random.normal, dtype=jnp.float32)
            out.append(dict(dense=normal(k1, (1, H, H)) / np.sqrt(H),
                            router=normal(k2, (H, E)) / np.sqrt(H),
                            w_in=normal(k3, (E, H, F)) / np.sqrt(H),
                            w_out=normal(k4, (E, F, H)) / np.sqrt(F)))
        return jax.tree.map(lambda a: a.astype(jnp.bfloat16), out)

    return jax.jit(make, out_shardings=shardings)(key)


class Layer:
    """One layer's pieces on this rank's tokens; ``sms``: the SMs its GEMMs are sized for
    (None: every SM)."""

    def __init__(self, p, sms, backend, E, K, M, layout="blocks"):
        self.p, self.sms = p, sms
        self.ll = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, backend=backend,
                       layout=layout)
        self.K, self.cuda = K, backend == "cuda"

    def dense(self, x):
        return x + batched_matmul(x[None], self.p["dense"], sm_count=self.sms)[0]

    def route(self, h):
        logits = jnp.dot(h, self.p["router"], preferred_element_type=jnp.float32)
        top, idx = jax.lax.top_k(logits, self.K)
        return idx.astype(jnp.int32), jax.nn.softmax(top, axis=-1)

    def experts(self, received):
        rows = jax_ep.dequantize_fp8(received.x, received.x_scales, jnp.bfloat16)
        if self.ll["layout"] != "blocks":  # packed rows, groups of recv_count
            gmm = partial(grouped_matmul, group_sizes=received.recv_count,
                          impl="cuda" if self.cuda else "auto",
                          sm_count=self.sms if self.cuda else None)
            # records: each token once, the packed rows read by the handle's index
            index = (received.handle.record_rows() if self.ll["layout"] == "records"
                     else None)
            h = jax.nn.silu(gmm(rows, self.p["w_in"], row_index=index))
            return gmm(h, self.p["w_out"])
        h = jax.nn.silu(batched_matmul(rows, self.p["w_in"], sm_count=self.sms))
        return batched_matmul(h, self.p["w_out"], sm_count=self.sms)  # [L, R*M, H]

    def fused(self, x):
        h = self.dense(x)
        idx, gates = self.route(h)
        received = jax_ep.low_latency_dispatch(h, idx, **self.ll)
        return h + jax_ep.low_latency_combine(self.experts(received), gates, received.handle)


def in_turn(params, xa, xb, *, backend, E, K, M, layout, sms=None):
    """A's layers, then B's: every call fused, every GEMM on every SM (or on ``sms``)."""
    for p in params:
        layer = Layer(p, sms, backend, E, K, M, layout)
        xa = layer.fused(xa)
        xb = layer.fused(tie((xb, xa))[0])
    return xa, xb


def interleaved(params, xa, xb, *, backend, E, K, M, layout, sms):
    """Each send followed by the other micro-batch's GEMMs, then its receive."""
    rx, tx = jax_ep.low_latency_dispatch_receive, jax_ep.low_latency_dispatch_send
    crx, ctx = jax_ep.low_latency_combine_receive, jax_ep.low_latency_combine_send
    for p in params:
        dispatch = Layer(p, sms["dispatch"], backend, E, K, M, layout)
        combine = Layer(p, sms["combine"], backend, E, K, M, layout)
        ha = dispatch.dense(xa)
        ia, ga = dispatch.route(ha)
        sa = tx(ha, ia, **dispatch.ll)
        xb, sa = tie((xb, sa))
        hb = dispatch.dense(xb)                        # beside A's dispatch
        ib, gb = dispatch.route(hb)
        hb, sa = tie((hb, sa))
        ra = rx(sa)
        hb, ib, ra = tie((hb, ib, ra))                 # B's send after A's receive
        sb = tx(hb, ib, **dispatch.ll)
        ra, sb = tie((ra, sb))
        ya = dispatch.experts(ra)                      # beside B's dispatch
        ya, sb = tie((ya, sb))
        rb = rx(sb)
        ya, rb = tie((ya, rb))
        ca = ctx(ya, ga, ra.handle)
        rb, ca = tie((rb, ca))
        yb = combine.experts(rb)                       # beside A's combine
        yb, ca = tie((yb, ca))
        za = crx(ca, ra.handle)
        yb, za = tie((yb, za))                         # B's combine after A's receive
        zb = crx(ctx(yb, gb, rb.handle), rb.handle)
        xa, xb = ha + za, hb + zb
    return xa, xb


def median_ms(f, *a, repeats):
    jax.block_until_ready(f(*a))  # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main():
    if launched:
        from jax_ep import launch

        launch.init_distributed()
    R = jax.device_count()
    T, H, F, E, K, N = args.tokens, args.hidden, args.ffn, args.experts, args.top_k, args.layers
    if E % R:
        sys.exit(f"--experts={E} must be divisible by the {R} devices")
    if H % 128:
        sys.exit(f"--hidden={H} must be a multiple of 128 (one FP8 scale per 128 channels)")
    if args.backend == "cuda" or (args.backend == "auto" and jax.default_backend() == "gpu"):
        from jax_ep import runtime

        # before the backend is resolved: the CUDA backend needs the runtime to be up
        runtime.initialize(low_latency_bytes=jax_ep.low_latency_buffer_size_hint(T, H, E, K, R))
    backend = jax_ep.api._resolve_backend(args.backend)
    mesh = jax.make_mesh((R,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    specs = [dict(dense=P(), router=P(), w_in=P(AXIS), w_out=P(AXIS))] * N
    params = init_params(jax.random.key(0), H, F, E, N,
                         [jax.tree.map(lambda s: NamedSharding(mesh, s), sp) for sp in specs])
    shard = NamedSharding(mesh, P(AXIS))
    # tokens made where they live, as the weights: a device_put of one process's array would
    # compare it across processes first (a collective)
    tokens = jax.jit(lambda k: jax.random.normal(k, (R * T, H), jnp.bfloat16), out_shardings=shard)
    xa, xb = tokens(jax.random.key(1)), tokens(jax.random.key(2))
    sms = {op: jax_ep.low_latency_split_gemm_sms(op) for op in ("dispatch", "combine")}
    common = dict(backend=backend, E=E, K=K, M=T, layout=args.layout)

    def compiled(fn, layers):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs[:layers], P(AXIS), P(AXIS)),
                                     out_specs=(P(AXIS), P(AXIS))))

    plain = compiled(partial(in_turn, **common), N)
    split = compiled(partial(interleaved, sms=sms, **common), N)

    # One layer, the same GEMMs both ways: the same tokens, up to XLA's fusions rounding
    # differently in the two programs (on the reference backend an FP8 scale too, moving a
    # code by a step; the CUDA kernels quantize alike in both).
    sized = compiled(partial(in_turn, sms=sms["dispatch"], **common), 1)
    want = sized(params[:1], xa, xb)
    got = compiled(partial(interleaved, sms={op: sms["dispatch"] for op in sms}, **common),
                   1)(params[:1], xa, xb)
    tol = 2e-2 if backend == "cuda" else 0.1
    for w, g in zip(want, got):  # this process's shards: no collective to gather them
        for ws, gs in zip(w.addressable_shards, g.addressable_shards):
            np.testing.assert_allclose(np.asarray(gs.data, np.float32),
                                       np.asarray(ws.data, np.float32), rtol=tol, atol=tol)
    t_plain = median_ms(plain, params, xa, xb, repeats=args.repeats)
    t_split = median_ms(split, params, xa, xb, repeats=args.repeats)
    if jax.process_index() == 0:
        beside = ("every SM" if sms["dispatch"] is None else
                  f"{sms['dispatch']} SMs (dispatch) / {sms['combine']} (combine)")
        print(f"{R} devices ({jax.default_backend()}), backend={backend}, {N} layers, two "
              f"micro-batches of T={T}/rank, H={H} F={F} E={E} top-{K}, {args.layout} rows; "
              f"the GEMMs beside the split calls on {beside}")
        print("the interleaved schedule's tokens match the one in turn")
        print(f"in turn (fused calls):      {1e3 * t_plain / N:9.1f} µs per layer")
        print(f"interleaved (split calls):  {1e3 * t_split / N:9.1f} µs per layer"
              + ("" if backend == "cuda" else "  (the reference backend: no overlap to see)"))


if __name__ == "__main__":
    main()
