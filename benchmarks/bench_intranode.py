"""Intranode normal-mode benchmark: jax_ep layout / dispatch / combine next to what JAX offers.

    python -m jax_ep.launch -n 2 benchmarks/bench_intranode.py            # one process per GPU
    python benchmarks/bench_intranode.py --tokens 256 --hidden 512         # CPU, reference only

Every row is the time of one call as XLA runs it (a jitted function, median of repeats) and
DeepEP's *logical* bandwidth: bytes of the rank-deduplicated tokens a rank receives (its own
ones included) divided by that time. Baselines in the same run: ``jax.lax.ragged_all_to_all``
(deduplicated rows) and a capacity-padded ``jax.lax.all_to_all``.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--routing", default="random", choices=["random", "zipf", "hot"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--cpu-devices", type=int, default=4, help="fake devices for CPU runs")
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


def put(array, sharding):
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def timeit(f, *a):
    jax.block_until_ready(f(*a))
    jax.block_until_ready(f(*a))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.iters):
            out = f(*a)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / args.iters)
    return float(np.median(times))


def main():
    if "JAX_EP_RANK" in os.environ:
        from jax_ep import launch

        launch.init_distributed()
    R, T, H, K, E = jax.device_count(), args.tokens, args.hidden, args.topk, args.experts
    L = E // R
    backend = args.backend
    if backend != "reference" and jax.default_backend() == "gpu":
        from jax_ep import runtime

        runtime.initialize()
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

    def record(name, f, *a, nbytes=bytes_bf16):
        try:
            t = timeit(f, *a)
            rows.append((name, t * 1e6, nbytes / t / 1e9 if nbytes else float("nan")))
        except Exception as e:  # a failing row must not hide the others
            rows.append((name, float("nan"), float("nan")))
            if jax.process_index() == 0:
                print(f"{name} FAILED: {type(e).__name__}: {str(e)[:400]}")

    # ------------------------------------------------------------------ jax_ep
    capacity = int(recv_tokens.max())  # tight static capacity: nothing dropped

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),))
    def layout(idx):
        out = jax_ep.get_dispatch_layout(idx, E, axis_name=AXIS, backend=backend)
        return out.num_tokens_per_rank[None]

    def make_dispatch(fp8, layout_name="rank_major", cap=capacity):
        @jax.jit
        @partial(smap, in_specs=(P(AXIS),) * 3)
        def run(x, idx, w):
            xin = jax_ep.quantize_fp8(x) if fp8 else x
            out = jax_ep.dispatch(xin, idx, w, num_experts=E, axis_name=AXIS, capacity=cap,
                                  layout=layout_name, backend=backend)
            return out.x[:1], out.num_received[None]
        return run

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),) * 3)
    def dispatch_for_combine(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                              backend=backend)
        return out.x, jax.tree.map(lambda a: a[None], out.handle)

    @jax.jit
    @partial(smap, in_specs=(P(AXIS), P(AXIS)))
    def combine(y, handle):
        return jax_ep.combine(y, jax.tree.map(lambda a: a[0], handle))

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),) * 3)
    def quantize_only(x, idx, w):
        return jax_ep.quantize_fp8(x)[0][:1]

    record("jax_ep layout", layout, idx_d, nbytes=0)
    record("jax_ep dispatch BF16", make_dispatch(False), x, idx_d, w)
    t_q = timeit(quantize_only, x, idx_d, w)
    record("jax_ep dispatch FP8 (incl. quantize)", make_dispatch(True), x, idx_d, w,
           nbytes=bytes_fp8)
    em_cap = int(np.bincount(idx.reshape(-1), minlength=E).reshape(R, L).sum(1).max())
    pairs_bytes = float(np.mean(np.bincount(dest.reshape(-1), minlength=R))) * H * 2
    record("jax_ep dispatch BF16 expert_major (per pair)",
           make_dispatch(False, "expert_major", em_cap), x, idx_d, w, nbytes=pairs_bytes)
    record("jax_ep combine BF16", combine, *dispatch_for_combine(x, idx_d, w))

    # ------------------------------------------------------------------ baselines
    if not args.skip_baselines:
        rows.extend(baselines(R, T, H, in_rank, counts, x, shard, smap, bytes_bf16))

    if jax.process_index() == 0:
        print(f"\n{R}×{jax.devices()[0].device_kind} backend={backend} T={T}/rank H={H} "
              f"top-{K} of {E} ({args.routing} routing); mean received tokens/rank "
              f"{mean_recv:.0f} ({bytes_bf16 / 1e6:.1f} MB BF16); quantize alone "
              f"{t_q * 1e6:.1f} µs")
        print(f"| {'operation':52s} | {'µs':>9s} | {'GB/s logical':>12s} |")
        print(f"|{'-' * 54}|{'-' * 11}|{'-' * 14}|")
        for name, us, gbs in rows:
            print(f"| {name:52s} | {us:9.1f} | {gbs:12.1f} |")


def baselines(R, T, H, in_rank, counts, x, shard, smap, nbytes):
    """ragged_all_to_all (deduplicated rows) and a capacity-padded all_to_all."""
    S = int(counts.sum(1).max())
    Rv = int(counts.sum(0).max())
    C = int(counts.max())
    idx = np.zeros((R, S), np.int32)
    in_off = np.zeros((R, R), np.int32)
    out_off = np.zeros((R, R), np.int32)
    didx = np.zeros((R, R, C), np.int32)
    for r in range(R):
        order = np.concatenate([np.nonzero(in_rank[r, :, d])[0] for d in range(R)])
        idx[r, : len(order)] = order
        in_off[r] = np.concatenate([[0], np.cumsum(counts[r])[:-1]])
        for d in range(R):
            tok = np.nonzero(in_rank[r, :, d])[0]
            didx[r, d, : len(tok)] = tok
    for d in range(R):
        out_off[:, d] = np.concatenate([[0], np.cumsum(counts[:, d])[:-1]])
    flat = lambda a: put(a.reshape((R * a.shape[1],) + a.shape[2:]), shard)  # noqa: E731
    ragged_args = (flat(idx), flat(in_off), flat(counts), flat(out_off),
                   flat(np.ascontiguousarray(counts.T)))

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),) * 6)
    def ragged(x, idx, in_off, sizes, out_off, recv_sizes):
        send = jnp.take(x, idx, axis=0)
        out = jnp.zeros((Rv, H), x.dtype)
        return jax.lax.ragged_all_to_all(send, out, in_off, sizes, out_off, recv_sizes,
                                         axis_name=AXIS)

    @jax.jit
    @partial(smap, in_specs=(P(AXIS),) * 2)
    def padded(x, didx):
        send = jnp.take(x, didx.reshape(-1), axis=0).reshape(R, C, H)
        return jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True).reshape(R * C, H)

    rows = []
    for name, f, a in [("jax.lax.ragged_all_to_all", ragged, (x, *ragged_args)),
                       ("jax.lax.all_to_all (capacity-padded)", padded, (x, flat(didx)))]:
        try:
            t = timeit(f, *a)
            rows.append((name, t * 1e6, nbytes / t / 1e9))
        except Exception as e:
            rows.append((name, float("nan"), float("nan")))
            if jax.process_index() == 0:
                print(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}")
    return rows


if __name__ == "__main__":
    main()
