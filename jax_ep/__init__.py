"""jax_ep: expert-parallel Mixture-of-Experts dispatch and combine for JAX.

Call inside ``jax.shard_map`` over an expert-parallel mesh axis::

    out = jax_ep.dispatch(x, topk_idx, topk_weights, num_experts=E, axis_name="ep")
    y = experts(out.x, ...)
    x_back = jax_ep.combine(y, out.handle)
"""

from jax_ep._types import (
    EXPERT_MAJOR,
    RANK_MAJOR,
    DispatchConfig,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
)
from jax_ep.api import (
    combine,
    cuda_available,
    default_capacity,
    dispatch,
    get_dispatch_layout,
)
from jax_ep import moe
from jax_ep.fp8 import dequantize_fp8, quantize_fp8

__version__ = "0.1.0"

__all__ = [
    "EXPERT_MAJOR",
    "RANK_MAJOR",
    "DispatchConfig",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchOutput",
    "combine",
    "cuda_available",
    "default_capacity",
    "dequantize_fp8",
    "dispatch",
    "get_dispatch_layout",
    "moe",
    "quantize_fp8",
]
