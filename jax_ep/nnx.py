"""Flax NNX module of the expert-parallel MoE layer (``jax_ep.moe.moe_layer``, and
``moe.decode_layer`` for decode steps).

Flax is an optional dependency: ``import jax_ep`` never imports it, this module needs it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

try:
    from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("jax_ep.nnx needs Flax: pip install jax_ep[flax]") from e

from jax_ep import moe

__all__ = ["MoE"]

# fan-in of [E, H, F] / [E, F, H] expert weights is the middle dim: dim 0 is the expert batch
_expert_init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
_router_init = nnx.initializers.normal(0.02)
_shared_init = nnx.initializers.lecun_normal()


class MoE(nnx.Module):
    """Router + ``num_experts`` routed SwiGLU experts + an optional shared SwiGLU expert.

    Expert weights are ``[E, ...]`` Params annotated ``(axis_name, None, None)`` (each rank of
    the EP axis holds ``E / R`` experts); router and shared expert are replicated. Built with a
    mesh (``mesh=`` or the ``jax.set_mesh`` context) the Params are created sharded.

    ``__call__(x)``: x ``[..., H]``, its leading (token) dims flattened and sharded over
    ``token_axes`` (default: ``axis_name`` alone; other mesh axes replicate it); runs
    ``moe.moe_layer`` under ``jax.shard_map`` on ``mesh`` (default: the mesh current at call
    time) and returns ``(y like x, moe.MoEAux)``. With ``token_axes`` such as
    ``("data", "expert")`` on a ``(data, expert)`` mesh every data index is its own EP group
    (the experts replicated over ``data``), and the auxiliary outputs cover all of them:
    counts summed, losses averaged over the groups. Add ``aux.load_balancing_loss`` (and
    ``router_z_loss``) to the training loss with the coefficients you want.
    ``decode(x)``: the same for a decode step, through the low-latency calls.
    ``config``: a ``jax_ep.Config`` for the dispatch and combine.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, *, top_k: int,
                 shared_ffn: int | None = None, axis_name="ep", mesh=None, capacity=None,
                 capacity_factor=None, expert_alignment: int = 1, renormalize: bool = True,
                 backend: str = "auto", token_axes=None, config=None, param_dtype=jnp.float32,
                 router_init=_router_init, expert_init=_expert_init,
                 shared_init=_shared_init, rngs: nnx.Rngs):
        where = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        if where.empty:
            raise ValueError("MoE needs a mesh with the EP axis: pass mesh= or build it under "
                             "jax.set_mesh(mesh)")
        if axis_name not in where.axis_names:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                             f"{where.axis_names}")
        token_axes = (axis_name,) if token_axes is None else tuple(token_axes)
        if axis_name not in token_axes or any(a not in where.axis_names for a in token_axes):
            raise ValueError(f"token_axes={token_axes} must be axes of the mesh "
                             f"{where.axis_names} and include axis_name={axis_name!r}")
        ranks = where.shape[axis_name]
        if num_experts % ranks:
            raise ValueError(f"num_experts={num_experts} must be divisible by the {ranks} "
                             f"ranks of axis {axis_name!r}")
        if capacity is not None and capacity_factor is not None:
            raise ValueError("give capacity or capacity_factor, not both")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.shared_ffn, self.axis_name, self.mesh = shared_ffn, axis_name, mesh
        self.capacity, self.capacity_factor = capacity, capacity_factor
        self.expert_alignment, self.renormalize, self.backend = (expert_alignment, renormalize,
                                                                 backend)
        self.token_axes, self.config = token_axes, config

        def param(init, shape, sharding):
            init = nnx.with_partitioning(init, sharding, mesh=mesh)
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        H, F, E, S = hidden, ffn, num_experts, shared_ffn
        experts = (axis_name, None, None)
        self.router = param(router_init, (H, E), (None, None))
        self.w_gate = param(expert_init, (E, H, F), experts)
        self.w_up = param(expert_init, (E, H, F), experts)
        self.w_down = param(expert_init, (E, F, H), experts)
        if S:
            self.shared_gate = param(shared_init, (H, S), (None, None))
            self.shared_up = param(shared_init, (H, S), (None, None))
            self.shared_down = param(shared_init, (S, H), (None, None))
        else:
            self.shared_gate = self.shared_up = self.shared_down = None

    def moe_params(self) -> moe.MoEParams:
        """The weights as global arrays (e.g. for ``moe.dense_moe_layer``)."""
        value = lambda v: None if v is None else v[...]  # noqa: E731
        return moe.MoEParams(*(value(getattr(self, f)) for f in moe.MoEParams._fields))

    def __call__(self, x):
        layer = partial(moe.moe_layer, top_k=self.top_k, axis_name=self.axis_name,
                        capacity=self.capacity, capacity_factor=self.capacity_factor,
                        expert_alignment=self.expert_alignment, renormalize=self.renormalize,
                        backend=self.backend, config=self.config)
        return self._run(layer, x)

    def decode(self, x, *, max_tokens_per_rank=None, use_fp8=True):
        """The same layer for a decode step (``moe.decode_layer``: the low-latency calls, the
        experts on the rows read by index): x ``[..., H]`` as in ``__call__``, at most
        ``max_tokens_per_rank`` tokens per device (default: its share of x); ``use_fp8``
        quantizes the rows for the wire. Capacity settings do not apply (nothing is dropped
        but pairs of a token listing an expert twice)."""
        layer = partial(moe.decode_layer, top_k=self.top_k, axis_name=self.axis_name,
                        max_tokens_per_rank=max_tokens_per_rank, use_fp8=use_fp8,
                        renormalize=self.renormalize, backend=self.backend, config=self.config)
        return self._run(layer, x)

    def _run(self, layer, x):
        """``layer(x, params)`` per device under ``jax.shard_map`` (see the class docstring)."""
        params = self.moe_params()
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("MoE was built without mesh=: call it under jax.set_mesh(mesh)")
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shards = 1
        for axis in self.token_axes:
            shards *= mesh.shape[axis]
        if x.shape[0] % shards:
            raise ValueError(f"{x.shape[0]} tokens do not split over the {shards} devices of "
                             f"axes {self.token_axes}")
        groups = tuple(a for a in self.token_axes if a != self.axis_name)

        def per_device(x, p):
            y, aux = layer(x, p)
            if groups:  # one EP group per index of these axes: aux over all of them
                aux = moe.MoEAux(jax.lax.pmean(aux.load_balancing_loss, groups),
                                 jax.lax.pmean(aux.router_z_loss, groups),
                                 jax.lax.psum(aux.tokens_per_expert, groups),
                                 jax.lax.psum(aux.num_dropped, groups))
            return y, aux

        tokens = P(self.token_axes if groups else self.axis_name)
        specs = params.partition_specs(self.axis_name)
        run = jax.shard_map(per_device, mesh=mesh, in_specs=(tokens, specs),
                            out_specs=(tokens, P()))
        if not _explicit(mesh):
            y, aux = run(x, params)
            return y.reshape(shape), aux
        # Explicit axes: shard_map takes inputs only as its specs say (no implicit resharding),
        # and y leaves with x's sharding, as an op on Explicit axes would
        def place(a, spec):
            return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec))

        given = jax.typeof(x).sharding.spec
        y, aux = run(place(x, tokens), jax.tree.map(place, params, specs))
        return place(y, given).reshape(shape), aux


def _explicit(mesh) -> bool:
    """Whether any axis of `mesh` is Explicit (jax.make_mesh's default from jax 0.7)."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))
