"""jax_ep: expert-parallel Mixture-of-Experts dispatch and combine for JAX.

Call inside ``jax.shard_map`` over an expert-parallel mesh axis::

    out = jax_ep.dispatch(x, topk_idx, topk_weights, num_experts=E, axis_name="ep")
    y = experts(out.x, ...)
    x_back = jax_ep.combine(y, out.handle)
"""

from jax_ep import experts, moe
from jax_ep._types import (
    EXPERT_MAJOR,
    RANK_MAJOR,
    SOURCE_SLOTS,
    DispatchConfig,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    LowLatencyHandle,
    LowLatencyOutput,
)
from jax_ep.api import (
    buffer_size_hint,
    combine,
    cuda_available,
    default_capacity,
    dispatch,
    get_dispatch_layout,
    on_stream,
)
from jax_ep.config import Config
from jax_ep.fp8 import dequantize_fp8, quantize_fp8
from jax_ep.low_latency import (
    low_latency_buffer_size_hint,
    low_latency_combine,
    low_latency_combine_receive,
    low_latency_combine_send,
    low_latency_dispatch,
    low_latency_dispatch_receive,
    low_latency_dispatch_send,
    low_latency_split_gemm_sms,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "EXPERT_MAJOR",
    "RANK_MAJOR",
    "SOURCE_SLOTS",
    "DispatchConfig",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchOutput",
    "LowLatencyHandle",
    "LowLatencyOutput",
    "buffer_size_hint",
    "combine",
    "cuda_available",
    "default_capacity",
    "dequantize_fp8",
    "dispatch",
    "experts",
    "get_dispatch_layout",
    "low_latency_buffer_size_hint",
    "low_latency_combine",
    "low_latency_combine_receive",
    "low_latency_combine_send",
    "low_latency_dispatch",
    "low_latency_dispatch_receive",
    "low_latency_dispatch_send",
    "low_latency_split_gemm_sms",
    "moe",
    "on_stream",
    "quantize_fp8",
]
