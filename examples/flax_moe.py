"""Train a small Flax NNX model with expert-parallel MoE layers (jax_ep.nnx.MoE).

CPU (default: 8 fake host devices, reference backend):
    python examples/flax_moe.py
GPUs (one process per GPU, CUDA kernels):
    python -m jax_ep.launch -n 2 examples/flax_moe.py --backend cuda

The model (in-projection, residual RMSNorm + MoE blocks with a shared expert, out-projection)
regresses a fixed random teacher network on random tokens. Tokens are sharded over the
expert-parallel axis; every rank holds E / R experts of each layer. Each step prints the task
loss, the load-balancing loss, the rows dropped for lack of capacity and the token throughput.
Needs Flax and optax (pip install jax_ep[flax]).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (CPU runs only)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--ffn", type=int, default=32, help="hidden width of each routed expert")
    p.add_argument("--shared-ffn", type=int, default=32, help="shared expert width; 0 = none")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="received rows = factor x the uniform-routing average; 0 = worst case")
    p.add_argument("--aux-weight", type=float, default=1e-2, help="load-balancing loss weight")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args()


args = parse_args()
launched = "JAX_EP_RANK" in os.environ
if not launched and args.backend != "cuda":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.nnx import MoE  # noqa: E402

AXIS = "ep"


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        H = args.hidden
        self.inp = nnx.Linear(H, H, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(H, rngs=rngs) for _ in range(args.layers)])
        self.moes = nnx.List([
            MoE(H, args.ffn, args.experts, top_k=args.top_k, shared_ffn=args.shared_ffn or None,
                axis_name=AXIS, capacity_factor=args.capacity_factor or None,
                backend=args.backend, rngs=rngs)
            for _ in range(args.layers)])
        self.out = nnx.Linear(H, H, rngs=rngs)

    def __call__(self, x):
        h, balance, dropped = self.inp(x), 0.0, 0
        for norm, moe in zip(self.norms, self.moes):
            y, aux = moe(norm(h))
            h = h + y
            balance, dropped = balance + aux.load_balancing_loss, dropped + aux.num_dropped
        return self.out(h), balance / len(self.moes), dropped


def main():
    if os.environ.get("JAX_EP_SHARED_GPUS") == "1":
        # replicated parameters' gradients are XLA collectives (NCCL): one GPU per process
        sys.exit("this example needs one GPU per process: NCCL refuses several ranks on one "
                 "GPU (the launcher's --gpus); run it with -n at most the GPU count")
    if launched:
        from jax_ep import launch

        launch.init_distributed()
    devices = jax.devices()
    R = len(devices)
    if args.experts % R:
        sys.exit(f"--experts={args.experts} must be divisible by the {R} devices")
    if args.backend == "cuda" or (args.backend == "auto" and jax.default_backend() == "gpu"):
        from jax_ep import runtime

        runtime.initialize()
    mesh = jax.make_mesh((R,), (AXIS,), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    tokens = NamedSharding(mesh, P(AXIS))
    H = args.hidden

    @jax.jit
    def batch(step):
        """Random tokens and the teacher's targets, created sharded (no host copy)."""
        data_key, teacher_key = jax.random.split(jax.random.key(0))
        x = jax.random.normal(jax.random.fold_in(data_key, step), (R * args.tokens, H))
        k1, k2 = jax.random.split(teacher_key)
        w1 = jax.random.normal(k1, (H, 4 * H)) / jnp.sqrt(H)
        w2 = jax.random.normal(k2, (4 * H, H)) / jnp.sqrt(4 * H)
        x = jax.lax.with_sharding_constraint(x, tokens)
        return x, jax.lax.with_sharding_constraint(jnp.tanh(x @ w1) @ w2, tokens)

    @nnx.jit
    def create():
        """Inside jit, so that every process builds its shards of the global parameters."""
        model = Model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, target):
        def loss_fn(model):
            y, balance, dropped = model(x)
            loss = jnp.mean((y - target) ** 2)
            return loss + args.aux_weight * balance, (loss, balance, dropped)

        grads, (loss, balance, dropped) = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, balance, dropped

    with jax.set_mesh(mesh):
        model, optimizer = create()
        if jax.process_index() == 0:
            print(f"{R} devices ({jax.default_backend()}), "
                  f"backend={jax_ep.api._resolve_backend(args.backend)}, {args.layers} MoE "
                  f"layers, T={args.tokens}/rank H={H} F={args.ffn} E={args.experts} "
                  f"top-{args.top_k} shared={args.shared_ffn}, "
                  f"capacity factor={args.capacity_factor or 'worst case'}")
        for step in range(args.steps):
            x, target = batch(step)
            t0 = time.perf_counter()
            loss, balance, dropped = train_step(model, optimizer, x, target)
            loss = float(loss)
            dt = time.perf_counter() - t0
            if jax.process_index() == 0:
                note = " (includes compilation)" if step == 0 else ""
                print(f"step {step:3d}  loss {loss:.5f}  balance {float(balance):.4f}  "
                      f"dropped {int(dropped):4d}  {R * args.tokens / dt:9.0f} tokens/s{note}",
                      flush=True)


if __name__ == "__main__":
    main()
