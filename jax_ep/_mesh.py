"""Mesh axes as the API and the CUDA backend see them: where the EP axis lies in the device
order, and which axes a value varies over inside ``shard_map``."""

from __future__ import annotations

import jax
import numpy as np


def abstract_mesh():
    """The mesh being traced (inside ``shard_map`` or a mesh context), or None where this jax
    has no ``get_abstract_mesh``; outside both, an empty mesh."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)  # absent in older jax
    return get_mesh() if get_mesh is not None else None


def axis_stride(axis_name, num_ranks) -> int:
    """The EP axis's stride in the mesh's row-major device order (the product of the sizes of
    the axes after it; 1 outside a mesh context, as in the lowering tests)."""
    mesh = abstract_mesh()
    shape = dict(getattr(mesh, "shape", None) or {})
    names, sizes = tuple(shape), tuple(shape.values())
    if axis_name not in names:
        return 1
    k = names.index(axis_name)
    if sizes[k] != num_ranks:
        raise ValueError(f"the expert-parallel axis {axis_name!r} has {sizes[k]} devices, the "
                         f"call was set up for {num_ranks}")
    return int(np.prod(sizes[k + 1:], dtype=np.int64))


def traced_platform() -> str | None:
    """The platform ("gpu", "cpu", ...) of the devices of the mesh being traced (inside
    ``shard_map``, or under a mesh context such as ``jax.set_mesh``); None outside a mesh or
    where this jax's abstract mesh does not say."""
    return getattr(getattr(abstract_mesh(), "abstract_device", None), "platform", None)


def varying_axes(value) -> tuple:
    """The mesh axes over which ``value`` varies inside ``shard_map``, sorted (() outside it);
    jax keeps them in the aval's manual-axes type (0.11) or its ``vma`` (0.7 to 0.10)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return ()
    aval = typeof(value)
    kind = getattr(aval, "mat", None)
    if kind is None:
        kind = getattr(aval, "manual_axis_type", None)
    axes = kind.varying if kind is not None else getattr(aval, "vma", None)
    return tuple(sorted(axes or ()))


def as_varying(value, axes):
    """``value`` typed as varying over ``axes`` as well (a type cast: no data moves). pcast
    refuses values that already are (or are treated as, when the checks are off): keep those."""
    axes = tuple(sorted(axes))
    if not axes:
        return value
    try:
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(value, axes, to="varying")
        return jax.lax.pvary(value, axes)
    except ValueError:
        return value


def vary_alike(*arrays):
    """Each array typed as varying over every mesh axis any of them varies over.

    Inside ``shard_map`` a custom_vjp's cotangents must vary over exactly the axes of their
    primal inputs, and values that JAX types as invariant (a collective's output, a replicated
    weight) get a cast where they meet varying ones, whose transpose is a sum over the mesh;
    casting them first keeps both where the caller wants them.
    """
    vmas = [frozenset(varying_axes(a)) for a in arrays]
    union = frozenset().union(*vmas)
    return tuple(as_varying(a, union - vma) for a, vma in zip(arrays, vmas))
