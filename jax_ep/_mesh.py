"""Where a mesh axis lies in the device order (shared by the API and the CUDA backend)."""

from __future__ import annotations

import jax
import numpy as np


def axis_stride(axis_name, num_ranks) -> int:
    """The EP axis's stride in the mesh's row-major device order (the product of the sizes of
    the axes after it; 1 outside a mesh context, as in the lowering tests)."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)  # absent in older jax
    mesh = get_mesh() if get_mesh is not None else None
    shape = dict(getattr(mesh, "shape", None) or {})
    names, sizes = tuple(shape), tuple(shape.values())
    if axis_name not in names:
        return 1
    k = names.index(axis_name)
    if sizes[k] != num_ranks:
        raise ValueError(f"the expert-parallel axis {axis_name!r} has {sizes[k]} devices, the "
                         f"call was set up for {num_ranks}")
    return int(np.prod(sizes[k + 1:], dtype=np.int64))
