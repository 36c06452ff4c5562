"""Train a small expert-parallel MoE model for a few steps.

CPU (default: 8 fake host devices, reference backend):
    python examples/moe_layer.py
GPUs (one process per GPU, CUDA kernels):
    python -m jax_ep.launch -n 2 examples/moe_layer.py --backend cuda

The model is two residual MoE feed-forward blocks regressing a fixed random teacher network;
tokens are sharded over the expert-parallel axis and every rank holds E / R experts. With
``--data-parallel D`` the mesh is (data=D, ep=N/D): D expert-parallel groups run at once, each
over its own devices, the experts replicated over the data axis (both backends). Each step
prints the loss, the rows dropped for lack of capacity, and the token
throughput.
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layout", default="expert_major",
                   choices=["expert_major", "rank_major", "source_slots"])
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="receive rows = factor x the average; 0 = worst case (source_slots: R*T)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="tokens and expert matmuls (parameters and optimizer stay float32)")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam step; default 3e-2 * 64 / hidden (the step of a hidden weight "
                        "scales as 1 / fan-in: 3e-2 diverges at hidden 2048)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="data-parallel groups: mesh (data, ep) with EP over devices / this")
    return p.parse_args()


args = parse_args()
launched = "JAX_EP_RANK" in os.environ
if not launched and args.backend != "cuda":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import moe  # noqa: E402

AXIS, DATA = "ep", "data"


def init_params(key, H, F, E, layers=2):
    params = []
    for i in range(layers):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
        params.append(dict(
            router=jax.random.normal(k1, (H, E), jnp.float32) * 0.1,
            w_in=jax.random.normal(k2, (E, H, F), jnp.float32) / jnp.sqrt(H),
            w_out=jax.random.normal(k3, (E, F, H), jnp.float32) / jnp.sqrt(F) * 0.5,
        ))
    return params


def teacher(x, key):
    k1, k2 = jax.random.split(key)
    H = x.shape[-1]
    w1 = jax.random.normal(k1, (H, 4 * H)) / jnp.sqrt(H)
    w2 = jax.random.normal(k2, (4 * H, H)) / jnp.sqrt(4 * H)
    return jnp.tanh(x @ w1) @ w2


def main():
    if os.environ.get("JAX_EP_SHARED_GPUS") == "1":
        # the loss's pmean and the replicated parameters' gradients are XLA collectives (NCCL)
        sys.exit("this example needs one GPU per process: NCCL refuses several ranks on one "
                 "GPU (the launcher's --gpus); run it with -n at most the GPU count")
    if launched:
        from jax_ep import launch, runtime

        launch.init_distributed()
    devices = jax.devices()
    D = args.data_parallel
    if D < 1 or len(devices) % D:
        sys.exit(f"--data-parallel={D} must divide the {len(devices)} devices")
    R = len(devices) // D  # the EP group's size
    if args.experts % R:
        sys.exit(f"--experts={args.experts} must be divisible by the {R} devices of an EP group")
    if args.backend == "cuda" or (args.backend == "auto" and jax.default_backend() == "gpu"):
        from jax_ep import runtime

        runtime.initialize()
    mesh = jax.make_mesh((D, R), (DATA, AXIS), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    BOTH = (DATA, AXIS)
    T, H, F, E, K = args.tokens, args.hidden, args.ffn, args.experts, args.top_k
    L = E // R
    capacity = None
    if args.capacity_factor > 0 and args.layout != "source_slots":  # its rows are fixed: R*T
        per_expert = args.capacity_factor * T * K / L  # pairs an expert gets on average
        capacity = max(1, int(per_expert * L)) if args.layout == "expert_major" else max(
            1, int(args.capacity_factor * T * min(K, L)))
    specs = [dict(router=P(), w_in=P(AXIS), w_out=P(AXIS))] * 2

    dtype = jnp.dtype(args.dtype)
    lr = args.lr if args.lr is not None else 3e-2 * 64 / H

    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(BOTH), P(BOTH)), out_specs=(P(), P()))
    def loss_fn(params, x, target):
        h, dropped = x.astype(dtype), 0
        for layer in params:
            out, d = moe.moe_block(h, layer["router"], layer["w_in"].astype(dtype),
                                   layer["w_out"].astype(dtype), top_k=K, axis_name=AXIS,
                                   capacity=capacity, layout=args.layout, backend=args.backend)
            h, dropped = h + out, dropped + d
        loss = jnp.mean((h.astype(jnp.float32) - target) ** 2)
        return jax.lax.pmean(loss, BOTH), jax.lax.psum(dropped, BOTH)

    @jax.jit
    def train_step(params, opt, x, target):
        (loss, dropped), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
        if args.clip > 0:
            norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, args.clip / (norm + 1e-6)), grads)
        step, m, v = opt
        step = step + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
        bc1, bc2 = 1 - 0.9 ** step, 1 - 0.999 ** step
        params = jax.tree.map(
            lambda p, m, v: p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + 1e-8), params, m, v)
        return params, (step, m, v), loss, dropped

    key = jax.random.key(0)
    shard = NamedSharding(mesh, P(BOTH))
    params = jax.device_put(init_params(key, H, F, E),
                            [jax.tree.map(lambda s: NamedSharding(mesh, s), sp) for sp in specs])
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt = (jax.device_put(jnp.zeros((), jnp.float32), NamedSharding(mesh, P())), zeros, zeros)
    teacher_key = jax.random.fold_in(key, 99)
    backend = jax_ep.api._resolve_backend(args.backend)
    if jax.process_index() == 0:
        print(f"{D * R} devices ({jax.default_backend()}; {D} EP group(s) of {R}), "
              f"backend={backend}, layout={args.layout}, "
              f"T={T}/rank H={H} F={F} E={E} top-{K}, capacity={capacity or 'worst case'}, "
              f"{args.dtype}, lr {lr:.2g}")
    for step in range(args.steps):
        xkey = jax.random.fold_in(key, 1000 + step)
        x = jax.random.normal(xkey, (D * R * T, H), jnp.float32)
        x = jax.device_put(x, shard)
        target = jax.device_put(teacher(x, teacher_key), shard)
        t0 = time.perf_counter()
        params, opt, loss, dropped = train_step(params, opt, x, target)
        loss = float(loss)
        dt = time.perf_counter() - t0
        if jax.process_index() == 0:
            note = " (includes compilation)" if step == 0 else ""
            print(f"step {step:3d}  loss {loss:.5f}  dropped {int(dropped):4d}  "
                  f"{D * R * T / dt:10.0f} tokens/s{note}", flush=True)


if __name__ == "__main__":
    main()
