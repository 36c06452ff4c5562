"""One MoE layer training step, its expert parallelism done six ways, timed on the same routing.

The step: router (float32) -> top-k softmax gates -> expert parallelism -> SwiGLU experts
(``jax_ep.experts.swiglu_mlp`` on expert-grouped rows) -> back to the tokens, plus a shared
expert (dense SwiGLU on the local tokens); ``jax.grad`` of a scalar loss w.r.t. x and every
weight, one jitted program. The ways:

  a  jax_ep ``dispatch(layout="expert_major", expert_alignment=128)`` -> experts -> ``combine``
  b  jax_ep ``dispatch(layout="rank_major")`` -> sort the (row, local expert) pairs by expert
     -> experts -> un-sort, gate-weighted sum per row -> ``combine``
  c  MaxText's: sort the (token, k) pairs by expert, counts to every rank (``all_gather``),
     ``jax.lax.ragged_all_to_all`` of the rows, sort them by local expert -> experts -> reverse
  d  ``jax.lax.all_to_all`` of per-destination-rank buffers of fixed capacity (a token once per
     rank; overflow dropped and counted) -> b's local sort -> experts -> back
  e  a with ``jax_ep.Config(stream=1)``: the dispatch, the combine and their backward passes
     on XLA's stream 1, so the shared expert (and whatever else needs nothing from them) may
     run beside them (``--ways a,e``; CUDA backend, jax >= 0.10)
  f  a with the shared expert as a call on XLA's stream 1 (``jax_ep.on_stream``) and jax_ep's
     calls on the program's stream: XLA starts the shared expert first, so the dispatch and
     the combine may run beside it (``--ways a,e,f``)
  g  a with the expert GEMMs through ``jax_ep.experts.batched_matmul`` (cuBLASLt) on every SM
     (padded experts only)
  s  f through ``jax_ep.moe.shared_expert_beside``: the shared expert's GEMMs through
     ``jax_ep.experts.batched_matmul`` sized for the SMs the calls leave, so that the calls
     beside it get SMs (``moe_layer``'s default; ``--ways a,f,s``)

Run:

    python -m jax_ep.launch -n 2 benchmarks/bench_moe_layer.py            # 2 GPUs: a, b, d
    python benchmarks/bench_moe_layer.py --single-process --ways c,d       # 1 process, all GPUs
    JAX_PLATFORMS=cpu python benchmarks/bench_moe_layer.py --tokens 64 --hidden 256 --ffn 128 \\
        --experts 32 --topk 4 --shared 128                                 # CPU, 8 fake devices

XLA refuses ``ragged_all_to_all`` across processes, and jax_ep's CUDA backend wants one process
per GPU, so way c runs in ``--single-process`` (all local GPUs in one process); there a and b
use the reference backend. Each run merges its rows into ``--results`` (a JSON file) and
prints every row of the same shapes found there, so the second command's table holds all four.

Columns: step = median wall time of one jitted step (each blocked on) after warm-up; comm =
the same step of a second program with the experts replaced by the identity and without the
router and shared expert (so: dispatch + combine, each way's own packing and local sorts
included, forward and backward), timed the same way; its share is comm / step (an upper
bound of what the step spends communicating, as XLA may overlap it with other work there).
Memory: the process's peak GPU bytes (monotone over the ways, which run in order) and XLA's
own buffers of the step's program (temporaries + outputs, from the compiled program); jax_ep's
NVSHMEM buffer is outside both. Capacity: ``--capacity-factor`` times what a rank receives under
uniform routing (clipped to the worst case); 1.25 drops nothing at random routing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from functools import partial

if __name__ == "__main__" and "JAX_EP_RANK" not in os.environ:
    # Fake host devices for CPU runs (harmless on GPUs: only the host platform reads it); set
    # before jax is imported.
    _cpu = argparse.ArgumentParser(add_help=False)
    _cpu.add_argument("--cpu-devices", type=int, default=8)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={_cpu.parse_known_args()[0].cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import experts as ep_experts  # noqa: E402
from jax_ep import moe as ep_moe  # noqa: E402

AXIS = "ep"
WAYS = {
    "a": "jax_ep expert_major",
    "b": "jax_ep rank_major + local sort",
    "c": "ragged_all_to_all + local sort (MaxText)",
    "d": "all_to_all, capacity-padded",
    "e": "jax_ep expert_major on XLA's stream 1",
    "f": "jax_ep expert_major, shared expert on stream 1",
    "g": "jax_ep expert_major, jax_ep's GEMMs (cuBLASLt)",
    "s": "jax_ep expert_major, shared expert on stream 1 on fewer SMs",
}


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True)
class Setup:
    """Static shapes and choices of one layer; every capacity derives from them."""

    ranks: int
    tokens: int  # per rank
    hidden: int
    ffn: int
    experts: int
    topk: int
    shared: int = 0  # shared expert's FFN width, 0: none
    capacity_factor: float = 1.25
    alignment: int = 128  # way a's expert groups
    backend: str = "reference"  # jax_ep's, ways a and b
    ragged: str = "native"  # way c: jax.lax.ragged_all_to_all, or "emulated" (CPU)
    shared_overlap: bool = True
    gemm_impl: str = "padded"  # the experts: per-expert [L, C, H] blocks, or grouped GEMMs
    axis: str = AXIS

    @property
    def expert_capacity(self) -> int:
        """Rows per expert block of the padded experts: factor * T * K / L, multiple of 8."""
        return 8 * math.ceil(self._factor(self.tokens * self.topk / self.local_experts) / 8)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    @property
    def hit(self) -> float:
        """Probability that a token has an expert on a given rank (uniform distinct top-k)."""
        E, L, K = self.experts, self.local_experts, self.topk
        return 1.0 - math.comb(E - L, K) / math.comb(E, K)

    def _factor(self, mean):
        return math.ceil(self.capacity_factor * mean)

    @property
    def rows_a(self) -> int:
        """expert_major rows: factor * T * K plus every group's alignment padding."""
        pad = self.local_experts * (self.alignment - 1)
        worst = self.ranks * self.tokens * self.topk
        return min(worst, self._factor(self.tokens * self.topk)) + pad

    @property
    def rows_b(self) -> int:
        """rank_major rows (one per token and destination rank)."""
        return min(self.ranks * self.tokens, self._factor(self.ranks * self.tokens * self.hit))

    @property
    def pairs(self) -> int:
        """(row, local expert) pairs one rank computes: b and d's sorted buffer, c's receive."""
        worst = self.ranks * self.tokens * min(self.topk, self.local_experts)
        return min(worst, self._factor(self.tokens * self.topk))

    @property
    def slots_d(self) -> int:
        """Way d's rows per (source, destination) buffer."""
        return min(self.tokens, self._factor(self.tokens * self.hit))


def init_params(key, s: Setup, dtype, mesh=None):
    """Global weights: router [H, E] f32, experts [E, H, F] / [E, F, H], shared [H, S] / [S, H].
    With a mesh, each device generates only its shard (nothing global on the host)."""
    H, F, E, S = s.hidden, s.ffn, s.experts, s.shared
    shapes = {"router": ((H, E), jnp.float32, H), "w_gate": ((E, H, F), dtype, H),
              "w_up": ((E, H, F), dtype, H), "w_down": ((E, F, H), dtype, F)}
    if S:
        shapes.update(shared_gate=((H, S), dtype, H), shared_up=((H, S), dtype, H),
                      shared_down=((S, H), dtype, S))
    specs = param_specs(s.shared, s.axis)
    params = {}
    for i, (name, (shape, dt, fan_in)) in enumerate(shapes.items()):
        def make(k, shape=shape, dt=dt, fan_in=fan_in):
            return jax.random.normal(k, shape, dt) * jnp.asarray(fan_in ** -0.5, dt)
        if mesh is None:
            params[name] = make(jax.random.fold_in(key, i))
        else:
            out = NamedSharding(mesh, specs[name])
            params[name] = jax.jit(make, out_shardings=out)(jax.random.fold_in(key, i))
    return params


def param_specs(shared, axis=AXIS):
    specs = {"router": P(), "w_gate": P(axis), "w_up": P(axis), "w_down": P(axis)}
    if shared:
        specs.update(shared_gate=P(), shared_up=P(), shared_down=P())
    return specs


# ----------------------------------------------------------------------------- pieces


def shared_swiglu(x, w_gate, w_up, w_down):
    """Dense SwiGLU on local tokens: [T, H] -> [T, H] in x's dtype (float32 accumulation)."""
    def dot(a, w):
        return jnp.dot(a, w.astype(a.dtype), preferred_element_type=jnp.float32)
    h = (jax.nn.silu(dot(x, w_gate)) * dot(x, w_up)).astype(x.dtype)
    return dot(h, w_down).astype(x.dtype)


def grouped_by_expert(rows, local_ids, gates, num_local, buffer_rows, expert_fn):
    """Per row, the gate-weighted sum of its local experts' outputs: the (row, expert) pairs are
    sorted into per-expert groups for one grouped GEMM and brought back.

    rows [N, H]; local_ids [N, K] (-1: none); gates [N, K] -> ([N, H] float32, pairs dropped
    for lack of buffer_rows). expert_fn(grouped [M, H], group_sizes [L]) -> [M, H].
    """
    N, K = local_ids.shape
    M = min(buffer_rows, N * K)
    key = jnp.where(local_ids >= 0, local_ids, num_local).reshape(-1)
    order = jnp.argsort(key, stable=True)[:M]  # valid pairs first, by expert
    counts = jnp.bincount(key, length=num_local + 1)[:num_local]
    ends = jnp.minimum(jnp.cumsum(counts), M)
    group_sizes = jnp.diff(ends, prepend=0).astype(jnp.int32)
    y = expert_fn(jnp.take(rows, order // K, axis=0), group_sizes)  # zero past the groups
    pos = jnp.full((N * K,), M, jnp.int32).at[order].set(jnp.arange(M, dtype=jnp.int32))
    y_pairs = jnp.take(y, pos.reshape(N, K), axis=0, mode="fill", fill_value=0)  # [N, K, H]
    out = jnp.sum(gates[..., None].astype(jnp.float32) * y_pairs.astype(jnp.float32), axis=1)
    return out, jnp.sum(counts) - ends[-1]


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all``'s semantics from a padded ``all_to_all`` (XLA:CPU has no
    ragged_all_to_all): lets way c run, and be tested, on CPU."""
    R, N = input_offsets.shape[0], operand.shape[0]
    j = jnp.arange(N)
    src = jnp.clip(input_offsets[:, None] + j, 0, N - 1)
    chunks = jnp.where((j < send_sizes[:, None])[..., None], jnp.take(operand, src, axis=0), 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [R(src), N, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst = jnp.where(j < recv_sizes[:, None], at[:, None] + j, output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(R * N, *operand.shape[1:]), mode="drop")


# ----------------------------------------------------------------------------- the six ways
#
# Each runs per device inside shard_map: (s, x [T, H], topk_idx [T, K] global ids, gates
# [T, K] f32, expert_fn) -> ([T, H] in x's dtype, rows/pairs this rank dropped).


def routed_a(s: Setup, x, topk_idx, gates, expert_fn):
    out = jax_ep.dispatch(x, topk_idx, gates, num_experts=s.experts, axis_name=s.axis,
                          capacity=s.rows_a, layout="expert_major",
                          expert_alignment=s.alignment, backend=s.backend)
    y = expert_fn(out.x, out.group_sizes)
    return jax_ep.combine(y, out.handle, weights=out.topk_weights), out.num_dropped


def routed_e(s: Setup, x, topk_idx, gates, expert_fn):
    out = jax_ep.dispatch(x, topk_idx, gates, num_experts=s.experts, axis_name=s.axis,
                          capacity=s.rows_a, layout="expert_major",
                          expert_alignment=s.alignment, backend=s.backend,
                          config=jax_ep.Config(stream=1))
    y = expert_fn(out.x, out.group_sizes)
    return jax_ep.combine(y, out.handle, weights=out.topk_weights), out.num_dropped


def routed_b(s: Setup, x, topk_idx, gates, expert_fn):
    out = jax_ep.dispatch(x, topk_idx, gates, num_experts=s.experts, axis_name=s.axis,
                          capacity=s.rows_b, layout="rank_major", backend=s.backend)
    rows, dropped = grouped_by_expert(out.x, out.topk_idx, out.topk_weights, s.local_experts,
                                      s.pairs, expert_fn)
    return jax_ep.combine(rows.astype(x.dtype), out.handle), out.num_dropped + dropped


def routed_c(s: Setup, x, topk_idx, gates, expert_fn):
    R, L, E, cap = s.ranks, s.local_experts, s.experts, s.pairs
    T, K = topk_idx.shape
    H = x.shape[1]
    me = jax.lax.axis_index(s.axis)
    ragged = (jax.lax.ragged_all_to_all if s.ragged == "native"
              else ragged_all_to_all_emulated)
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, k) pairs by global expert
    counts = jax.lax.all_gather(jnp.bincount(flat, length=E).astype(jnp.int32), s.axis)
    per = counts.reshape(R, R, L)  # [source, destination, local expert]
    sizes = per.sum(-1)
    at_dst = jnp.cumsum(sizes, axis=0) - sizes  # where a source's chunk lands at the destination
    kept = jnp.clip(cap - at_dst, 0, sizes)  # the destination's buffer overflows: dropped
    at_src = jnp.cumsum(sizes, axis=1) - sizes  # where a destination's chunk starts at the source
    sent = jnp.take(x, order // K, axis=0)
    got = ragged(sent, jnp.zeros((cap, H), x.dtype), at_src[me], kept[me], at_dst[me],
                 kept[:, me], axis_name=s.axis)
    # Received rows come by (source, local expert): each row's expert from the counts.
    mine = jnp.minimum(jnp.cumsum(per[:, me], axis=1), kept[:, me, None])  # [R, L]
    kept_sl = jnp.diff(mine, axis=1, prepend=0)
    bounds = jnp.cumsum(kept_sl.reshape(-1))
    rows = jnp.arange(cap)
    # searchsorted(bounds, rows, side="right") as a count (jax 0.6's searchsorted fails the
    # shard_map type check with varying bounds)
    after = jnp.sum(bounds[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
    local = jnp.where(rows < bounds[-1], after % L, L)
    perm = jnp.argsort(local, stable=True)
    y = expert_fn(jnp.take(got, perm, axis=0), kept_sl.sum(0).astype(jnp.int32))
    y = jnp.take(y, jnp.argsort(perm), axis=0)
    back = ragged(y, jnp.zeros((T * K, H), y.dtype), at_dst[:, me], kept[:, me], at_src[:, me],
                  kept[me], axis_name=s.axis)
    pairs = jnp.take(back, jnp.argsort(order), axis=0).reshape(T, K, H)
    out = jnp.sum(gates[..., None] * pairs.astype(jnp.float32), axis=1)
    return out.astype(x.dtype), sizes[:, me].sum() - bounds[-1]


def routed_d(s: Setup, x, topk_idx, gates, expert_fn):
    R, L, C = s.ranks, s.local_experts, s.slots_d
    T, K = topk_idx.shape
    H = x.shape[1]
    ranks = jnp.arange(R)
    dest = topk_idx // L
    to = dest[:, None, :] == ranks[None, :, None]  # [T, R, K]
    in_rank = to.any(-1)  # [T, R]
    slot = jnp.cumsum(in_rank, axis=0) - in_rank
    keep = in_rank & (slot < C)
    where = jnp.where(keep, slot, C)
    tok = jnp.zeros((R, C), jnp.int32).at[ranks, where].set(
        jnp.arange(T, dtype=jnp.int32)[:, None], mode="drop")
    used = jnp.zeros((R, C), bool).at[ranks, where].set(True, mode="drop")
    ids = jnp.where(to, (topk_idx % L)[:, None, :], -1)[tok, ranks[:, None]]  # [R, C, K]
    ids = jnp.where(used[..., None], ids, -1)
    row_gates = jnp.where(ids >= 0, gates[tok], 0.0)
    send = jnp.where(used[..., None], jnp.take(x, tok, axis=0), 0)  # [R, C, H]
    a2a = partial(jax.lax.all_to_all, axis_name=s.axis, split_axis=0, concat_axis=0, tiled=True)
    rows, dropped = grouped_by_expert(a2a(send).reshape(R * C, H), a2a(ids).reshape(R * C, K),
                                      a2a(row_gates).reshape(R * C, K), L, s.pairs, expert_fn)
    back = a2a(rows.astype(x.dtype).reshape(R, C, H))  # [R(expert rank), C, H]
    picked = back[ranks[None, :], jnp.where(keep, slot, 0)]  # [T, R, H]
    out = jnp.sum(jnp.where(keep[..., None], picked.astype(jnp.float32), 0.0), axis=1)
    return out.astype(x.dtype), jnp.sum(in_rank & ~keep) + dropped


ROUTED = {"a": routed_a, "b": routed_b, "c": routed_c, "d": routed_d, "e": routed_e,
          "f": routed_a, "g": routed_a, "s": routed_a}


# ----------------------------------------------------------------------------- layer and loss


def layer(s: Setup, way, params, x):
    """The MoE layer on this rank's tokens: ([T, H], rows/pairs dropped here)."""
    topk_idx, gates = ep_moe.route(x, params["router"], s.topk)
    cast = lambda w: w.astype(x.dtype)  # noqa: E731
    w = [cast(params[n]) for n in ("w_gate", "w_up", "w_down")]

    overflow = []

    def expert_fn(rows, group_sizes):
        if s.gemm_impl == "grouped":
            return ep_experts.swiglu_mlp(rows, *w, group_sizes)
        y, over = ep_experts.swiglu_mlp_padded(rows, *w, group_sizes,
                                               capacity=s.expert_capacity,
                                               gemm_sms=0 if way == "g" else None)
        overflow.append(over)
        return y

    shared = [params[n] for n in ("shared_gate", "shared_up", "shared_down")] if s.shared else []
    side = shared_swiglu
    if way == "f":
        side = jax_ep.on_stream(shared_swiglu)
    elif way == "s":
        side = ep_moe.shared_expert_beside
    sh = side(x, *shared) if shared and s.shared_overlap else None
    y, dropped = ROUTED[way](s, x, topk_idx, gates, expert_fn)
    dropped = dropped + sum(overflow)  # rows past an expert block (padded experts)
    if shared and not s.shared_overlap:  # only once the combine is done (and, in the backward,
        # the combine's gradient waits for the shared expert's)
        y, x_after = jax.lax.optimization_barrier((y, x))
        sh = shared_swiglu(x_after, *shared)
    return (y + sh if shared else y), dropped


def scalar_loss(y, axis=None):
    """0.5 * mean of y**2 over every token (float32); a psum over axis when given."""
    total = 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32)))
    count = y.size
    if axis is not None:
        total = jax.lax.psum(total, axis)
        count = count * jax.lax.axis_size(axis)
    return total / count


def make_step(s: Setup, way, mesh):
    """jit(params, x) -> (loss, rows dropped on all ranks, (d params, d x))."""
    specs = param_specs(s.shared, s.axis)

    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(s.axis)), out_specs=(P(), P()))
    def loss_fn(params, x):
        y, dropped = layer(s, way, params, x)
        return scalar_loss(y, s.axis), jax.lax.psum(dropped, s.axis)

    def step(params, x):
        (loss, dropped), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            params, x)
        return loss, dropped, grads

    return jax.jit(step)


def make_comm_step(s: Setup, way, mesh):
    """jit(x, topk_idx, gates) -> (loss, dropped, (d x, d gates)): the way's communication (and
    its packing and local sorts) alone, forward and backward: identity experts, no router, no
    shared expert."""

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(s.axis),) * 3, out_specs=(P(), P()))
    def loss_fn(x, topk_idx, gates):
        y, dropped = ROUTED[way](s, x, topk_idx, gates, lambda rows, group_sizes, *_: rows)
        return scalar_loss(y, s.axis), jax.lax.psum(dropped, s.axis)

    def step(x, topk_idx, gates):
        (loss, dropped), grads = jax.value_and_grad(loss_fn, argnums=(0, 2), has_aux=True)(
            x, topk_idx, gates)
        return loss, dropped, grads

    return jax.jit(step)


def make_routing(s: Setup, mesh):
    """jit(router, x) -> (topk_idx, gates), both sharded like x: the layer's own routing."""
    return jax.jit(jax.shard_map(lambda r, x: ep_moe.route(x, r, s.topk), mesh=mesh,
                                 in_specs=(P(), P(s.axis)), out_specs=P(s.axis)))


def group_sizes_uniform(s: Setup):
    """[L] group sizes as way a lays out uniform routing: T*K pairs over L experts, each group
    aligned; the sum is at most rows_a."""
    L, pairs = s.local_experts, s.tokens * s.topk
    n = np.full(L, pairs // L) + (np.arange(L) < pairs % L)
    aligned = -(-n // s.alignment) * s.alignment
    return aligned.astype(np.int32), int(n.sum())


def make_gemm_step(s: Setup, mesh):
    """jit(rows, w_gate, w_up, w_down) -> grads: swiglu_mlp forward + backward on way a's row
    buffer, alone (no communication), with uniform groups."""
    sizes, _ = group_sizes_uniform(s)
    wspec = P(s.axis)

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(s.axis), wspec, wspec, wspec), out_specs=P())
    def loss_fn(rows, w_gate, w_up, w_down):
        if s.gemm_impl == "grouped":
            y = ep_experts.swiglu_mlp(rows, w_gate, w_up, w_down, jnp.asarray(sizes))
        else:
            y, _ = ep_experts.swiglu_mlp_padded(rows, w_gate, w_up, w_down, jnp.asarray(sizes),
                                                capacity=s.expert_capacity)
        return scalar_loss(y, s.axis)

    return jax.jit(jax.grad(loss_fn, argnums=(0, 1, 2, 3)))


def dense_loss(s: Setup, params, x):
    """Single-device oracle of the step's loss: every expert on every token, global weights.
    Float32 matmuls of x's-dtype values, rounded to x's dtype where swiglu_mlp rounds (XLA:CPU
    has no batched bf16 x bf16 -> f32 dot)."""
    def rounded(a):
        return a.astype(x.dtype).astype(jnp.float32)

    topk_idx, gates = ep_moe.route(x, params["router"], s.topk)
    xf = x.astype(jnp.float32)
    w_gate, w_up, w_down = (rounded(params[n]) for n in ("w_gate", "w_up", "w_down"))
    gate = rounded(jnp.einsum("th,ehf->tef", xf, w_gate))
    up = rounded(jnp.einsum("th,ehf->tef", xf, w_up))
    h = rounded(jax.nn.silu(gate) * up)
    every = rounded(jnp.einsum("tef,efh->teh", h, w_down))  # [N, E, H]
    picked = jnp.take_along_axis(every, topk_idx[:, :, None], axis=1)
    y = jnp.sum(gates[..., None] * picked, axis=1).astype(x.dtype)
    if s.shared:
        y = y + shared_swiglu(x, params["shared_gate"], params["shared_up"],
                              params["shared_down"])
    return scalar_loss(y)


# ----------------------------------------------------------------------------- timing


def _same_on_all(value):
    """The largest of a host float over the processes (every process must loop equally often)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(value))))


def compile_all(programs, threads, options=None):
    """{name: (compiled, seconds) or the exception raised} for {name: (jitted f, args, ...)}:
    traced in turn, compiled by `threads` threads at once (XLA compiles without the GIL), with
    XLA compiler `options`."""
    from concurrent.futures import ThreadPoolExecutor

    lowered, done = {}, {}
    for name, (f, args, *_) in programs.items():
        try:
            lowered[name] = f.lower(*args)
        except Exception as e:
            done[name] = e

    def compile_one(item):
        name, low = item
        t0 = time.perf_counter()
        try:
            return name, (low.compile(compiler_options=options), time.perf_counter() - t0)
        except Exception as e:
            return name, e

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done.update(pool.map(compile_one, lowered.items()))
    return done


def time_program(compiled, args, steps, warmup, budget_s):
    """(median seconds of one call (each blocked on) after `warmup` calls, last outputs). Fewer
    than `steps` timed calls (at least 3) when the warm-up shows they would take longer than
    budget_s."""
    out, first = None, []
    for _ in range(max(1, warmup)):
        out = None  # the previous outputs (all gradients) are freed before the next call
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        first.append(time.perf_counter() - t0)
    n = max(3, min(steps, int(budget_s / max(_same_on_all(min(first)), 1e-6))))
    times = []
    for _ in range(n):
        out = None
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def _program_bytes(compiled):
    """XLA's buffers of a compiled program: temporaries + outputs (None if not reported)."""
    try:
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


def _peak_bytes():
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _flops(s: Setup):
    """Useful FLOPs of one step on one rank (forward + backward = 3x forward): routed experts
    on T*K pairs, shared expert on T tokens, router."""
    T, H, F, K, S, E = s.tokens, s.hidden, s.ffn, s.topk, s.shared, s.experts
    return 3 * (6 * T * K * H * F + 6 * T * H * S + 2 * T * H * E)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="routed expert FFN width")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--shared", type=int, default=2048,
                   help="shared expert FFN width (DeepSeek-V3: 1 shared expert of 2048); 0: none")
    p.add_argument("--shared-overlap", default="on", choices=["on", "off"],
                   help="on: the shared expert reads only x, so XLA may run it alongside the "
                        "dispatch; off: forced after the combine (optimization_barrier)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="received rows per rank = factor x their mean under uniform routing "
                        "(clipped to the worst case), for a, b, c, d alike")
    p.add_argument("--alignment", type=int, default=None,
                   help="way a's expert_alignment (default: 128 grouped, 8 padded)")
    p.add_argument("--gemm-impl", default="padded", choices=["padded", "grouped"],
                   help="experts as per-expert blocks of capacity-factor rows (batched GEMMs) "
                        "or grouped GEMMs over exactly the received rows")
    p.add_argument("--ways", default=None,
                   help="comma-separated subset of a,b,c,d,e,f,g,s; default a,b,c,d (c only in one "
                        "process: under the launcher a,b,d)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per program (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=8.0,
                   help="time the steps of one program for at most about this long (>= 3 steps)")
    p.add_argument("--comm", default="on", choices=["on", "off"],
                   help="also time each way's communication-only program")
    p.add_argument("--gemm", default="on", choices=["on", "off"],
                   help="also time the expert GEMMs alone")
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"],
                   help="jax_ep's backend (ways a, b, e, f); --single-process and CPU: reference")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--single-process", action="store_true",
                   help="one process over all local devices (for way c's ragged_all_to_all)")
    p.add_argument("--ragged", default="auto", choices=["auto", "native", "emulated"],
                   help="way c's collective: jax.lax.ragged_all_to_all (native) or its "
                        "all_to_all emulation; auto: native except on CPU (XLA:CPU lacks it)")
    p.add_argument("--results", default="/tmp/bench_moe_layer.json",
                   help="JSON file the rows are merged into ('' : none)")
    p.add_argument("--cpu-devices", type=int, default=8, help="fake host devices on CPU")
    p.add_argument("--compile-threads", type=int, default=4,
                   help="programs compiled at once before anything is timed; 1: one by one")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def jax_ep_backend(asked: str, single_process: bool = False) -> str:
    """jax_ep's backend for these benchmarks, decided before the runtime is initialised (so not
    by `_resolve_backend`, which wants it initialised): the kernels with one process per GPU
    where the extension loads, else the reference."""
    if (jax.default_backend() == "cpu" or single_process or asked == "reference"
            or jax.process_count() == 1 and jax.device_count() > 1):
        return "reference"  # jax_ep's CUDA backend runs one process per GPU
    from jax_ep import _native

    module, why = _native.load()
    if module is None:
        print(f"note: jax_ep's CUDA extension cannot load ({why})")
    return "cuda" if module is not None else "reference"


def main(argv=None):
    args = parse_args(argv)
    launched = "JAX_EP_RANK" in os.environ
    if launched and args.single_process:
        sys.exit("--single-process runs without the launcher: python benchmarks/"
                 "bench_moe_layer.py --single-process ...")
    if launched:
        from jax_ep import launch, runtime  # noqa: F401  (runtime: before JAX's GPU client
        # starts, so that XLA leaves room for the NVSHMEM buffer)

        launch.init_distributed()
    platform = jax.default_backend()
    R = jax.device_count()
    mode = "multi-process" if jax.process_count() > 1 else "single-process"
    backend = jax_ep_backend(args.backend, args.single_process)
    if args.backend == "cuda" and backend != "cuda":
        print(f"note: --backend cuda needs one process per GPU (jax_ep.launch); ways a, b, e, f "
              f"use the reference backend here ({mode}, {platform})")
    ragged = args.ragged if args.ragged != "auto" else ("emulated" if platform == "cpu"
                                                        else "native")
    ways = (args.ways or ("a,b,c,d" if jax.process_count() == 1 else "a,b,d")).split(",")
    dtype = jnp.dtype(args.dtype)
    if args.experts % R:
        sys.exit(f"--experts={args.experts} must be divisible by the {R} devices")
    s = Setup(ranks=R, tokens=args.tokens, hidden=args.hidden, ffn=args.ffn,
              experts=args.experts, topk=args.topk, shared=args.shared,
              capacity_factor=args.capacity_factor, backend=backend, gemm_impl=args.gemm_impl,
              alignment=args.alignment or (128 if args.gemm_impl == "grouped" else 8),
              ragged=ragged, shared_overlap=args.shared_overlap == "on")
    if backend == "cuda":
        from jax_ep import _cuda, runtime

        need = [runtime.default_buffer_bytes()]
        for layout, cap, align in (("expert_major", s.rows_a, s.alignment),
                                   ("rank_major", s.rows_b, 1)):
            try:
                need.append(_cuda.buffer_size_hint(s.tokens, s.hidden, s.topk, s.experts, R,
                                                   capacity=cap, dtype=dtype, layout=layout,
                                                   alignment=align))
            except Exception as e:  # the default size then; a call that needs more says so
                print(f"note: buffer_size_hint({layout}) failed: {e}")
        runtime.initialize(buffer_bytes=max(need))
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    mesh = jax.make_mesh((R,), (AXIS,), devices=jax.devices(),
                         axis_types=(jax.sharding.AxisType.Auto,))
    say(f"{R}x {jax.devices()[0].device_kind} ({platform}), {jax.process_count()} process(es), "
        f"jax {jax.__version__}, jax_ep backend {backend}, way c collective: {ragged}")
    say(f"T={s.tokens}/rank H={s.hidden} F={s.ffn} E={s.experts} (L={s.local_experts}/rank) "
        f"top-{s.topk} shared={s.shared or 'none'} (overlap {args.shared_overlap}) {args.dtype}; "
        f"capacity factor {s.capacity_factor}: a {s.rows_a} rows (align {s.alignment}), "
        f"b {s.rows_b} rows, b/c/d sorted pairs {s.pairs}, d {s.slots_d} rows per "
        f"(source, destination); mean pairs/rank {s.tokens * s.topk}, mean rank_major "
        f"rows/rank {s.ranks * s.tokens * s.hit:.0f}")

    key = jax.random.key(args.seed)
    params = init_params(key, s, dtype, mesh)
    shard = NamedSharding(mesh, P(AXIS))

    def normal(shape, salt):
        make = lambda k: jax.random.normal(k, shape, dtype)  # noqa: E731
        return jax.jit(make, out_shardings=shard)(jax.random.fold_in(key, salt))

    x = normal((R * s.tokens, s.hidden), 100)
    topk_idx, gates = make_routing(s, mesh)(params["router"], x)
    programs = {}
    for way in ways:
        if way not in ROUTED:
            say(f"unknown way {way!r}: choose from {', '.join(ROUTED)}")
        elif way == "c" and jax.process_count() > 1:
            say(f"({way}) {WAYS[way]}: skipped: XLA refuses ragged_all_to_all across "
                "processes; run `python benchmarks/bench_moe_layer.py --single-process "
                "--ways c,d`")
        else:
            programs[("step", way)] = (make_step(s, way, mesh), (params, x), None)
            if args.comm == "on":
                programs[("comm", way)] = (make_comm_step(s, way, mesh), (x, topk_idx, gates),
                                           None)
    gemm_rows, gemm_real = s.rows_a, group_sizes_uniform(s)[1]
    if args.gemm == "on":
        w = [params[n] for n in ("w_gate", "w_up", "w_down")]
        shape = (R * gemm_rows, s.hidden)  # allocated only when its turn comes
        programs[("gemm", "")] = (make_gemm_step(s, mesh), (
            jax.ShapeDtypeStruct(shape, dtype, sharding=shard), *w), lambda: (
            normal(shape, 101), *w))
    t0 = time.perf_counter()
    compiled = compile_all(programs, args.compile_threads)
    say(f"compiled {len(programs)} programs in {time.perf_counter() - t0:.0f} s "
        f"({args.compile_threads} at a time)")

    def run(name):
        """(median seconds, outputs) of one compiled program; raises what compiling raised."""
        c = compiled.pop(name)
        if isinstance(c, Exception):
            raise c
        _, lower_args, make_args = programs[name]
        return time_program(c[0], make_args() if make_args else lower_args, args.steps,
                            args.warmup, args.budget_s)

    rows, flops = [], _flops(s)
    for way in sorted({w for kind, w in programs if kind == "step"}, key=ways.index):
        name = f"({way}) {WAYS[way]}"
        row = dict(way=way, name=name, mode=mode,
                   backend=backend if way in "abefgs" else "xla")
        try:
            program_bytes = (_program_bytes(compiled[("step", way)][0])
                             if isinstance(compiled[("step", way)], tuple) else None)
            t, out = run(("step", way))
            loss, dropped = float(out[0]), int(out[1])
            del out  # the gradients
            row.update(step_ms=t * 1e3, loss=loss, dropped=dropped,
                       tflops=flops / t / 1e12, program_bytes=program_bytes,
                       peak_bytes=_peak_bytes())
            if ("comm", way) in programs:
                tc, _ = run(("comm", way))
                row.update(comm_ms=tc * 1e3)
            say(f"{name}: step {t * 1e3:.2f} ms, loss {loss:.6g}, dropped {dropped}"
                + (f", comm alone {row['comm_ms']:.2f} ms" if "comm_ms" in row else ""))
        except Exception as e:  # one way failing (OOM, unsupported op) must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            say(f"{name} FAILED: {row['error']}")
        compiled.pop(("comm", way), None)
        rows.append(row)

    gemm = None
    if ("gemm", "") in programs:
        try:
            tg, _ = run(("gemm", ""))
            useful = 18 * gemm_real * s.hidden * s.ffn
            gemm = dict(ms=tg * 1e3, tflops=useful / tg / 1e12, rows=gemm_rows, real=gemm_real)
        except Exception as e:
            gemm = dict(error=f"{type(e).__name__}: {str(e)[:600]}")
        programs.pop(("gemm", ""))
    if lead:
        report(s, args, rows, gemm, mode)


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def report(s: Setup, args, rows, gemm, mode):
    """Prints this run's rows, merged with the --results file's rows of the same shapes."""
    config = dict(ranks=s.ranks, tokens=s.tokens, hidden=s.hidden, ffn=s.ffn,
                  experts=s.experts, topk=s.topk, shared=s.shared, dtype=args.dtype,
                  capacity_factor=s.capacity_factor, alignment=s.alignment,
                  shared_overlap=args.shared_overlap, device=jax.devices()[0].device_kind)
    merged = list(rows)
    if args.results:
        try:
            with open(args.results) as f:
                saved = [r for r in json.load(f) if r.get("config") == config]
        except (OSError, ValueError):
            saved = []
        mine = {(r["way"], r["mode"]) for r in rows}
        others = [r for r in saved if (r["way"], r["mode"]) not in mine]
        merged = sorted(rows + others, key=lambda r: (r["way"], r["mode"]))
        try:
            with open(args.results, "w") as f:
                json.dump([dict(r, config=config) for r in merged], f, indent=1)
        except OSError as e:
            print(f"note: could not write {args.results}: {e}")
    ref = next((r for r in merged if r["way"] == "a" and "step_ms" in r), None)
    tokens = s.ranks * s.tokens
    print(f"\nMoE layer step, forward + backward, {s.ranks} ranks, {tokens} tokens in all "
          f"(rows from {args.results or 'this run'} with the same shapes included)")
    print("| way | run | step ms | tokens/s | TFLOP/s/GPU | comm ms | comm share | peak GiB "
          "| XLA GiB | dropped | loss | step vs (a) | comm vs (a) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gib = 2.0 ** 30
    for r in merged:
        run = f"{r['mode']}, {r['backend']}"
        if "error" in r:
            print(f"| {r['name']} | {run} | failed: {r['error'][:150]} |||||||||||")
            continue
        t, c = r["step_ms"], r.get("comm_ms")
        share = c / t if c is not None else None
        vs = t / ref["step_ms"] if ref else None
        cvs = c / ref["comm_ms"] if ref and c is not None and ref.get("comm_ms") else None
        peak = r["peak_bytes"] / gib if r.get("peak_bytes") is not None else None
        prog = r["program_bytes"] / gib if r.get("program_bytes") is not None else None
        print(f"| {r['name']} | {run} | {t:.2f} | {tokens / t * 1e3:,.0f} | "
              f"{r['tflops']:.3g} | {_fmt(c, '.2f')} | {_fmt(share, '.0%')} | "
              f"{_fmt(peak, '.1f')} | {_fmt(prog, '.2f')} | {r['dropped']} | "
              f"{r['loss']:.6g} | {_fmt(vs, '.2f')} | {_fmt(cvs, '.2f')} |")
    print("step: median wall ms of one jitted fwd+bwd step; TFLOP/s/GPU: useful FLOPs (routed "
          "experts on T*K pairs, shared expert, router; x3 for fwd+bwd) / step; comm: the same "
          "step with identity experts and no router / shared expert (dispatch + combine, each "
          "way's packing and local sorts, fwd+bwd), a separate program; comm share = comm / "
          "step; peak: process peak GPU bytes so far (monotone over the ways in run order); "
          "XLA: the step program's temporaries + outputs; dropped: rows (a: pairs; b, d: rows "
          "and sorted pairs; c: pairs) over all ranks")
    if gemm is not None:
        if "error" in gemm:
            print(f"\nexpert GEMMs alone FAILED: {gemm['error']}")
        else:
            print(f"\nexpert GEMMs alone (swiglu_mlp fwd+bwd per rank on way a's {gemm['rows']}-"
                  f"row buffer, {gemm['real']} real rows in {s.local_experts} uniform groups "
                  f"aligned to {s.alignment}): {gemm['ms']:.2f} ms, {gemm['tflops']:.3g} useful "
                  f"TFLOP/s (18 * rows * H * F)")


if __name__ == "__main__":
    main()
