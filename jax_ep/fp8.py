"""FP8 (e4m3) block quantisation: one float32 scale per 128 consecutive channels of a token.

``x ≈ data.astype(f32) * repeat(scales, 128)``. With ``ue8m0=True`` every scale is a power of
two (the UE8M0 format some FP8 GEMMs expect), at the cost of up to one bit of range.

The arithmetic is spelled out so that XLA compiles it as written (it rewrites a division by
a constant or by a broadcast into a multiplication by a reciprocal):
``scale = max(amax, 1e-10) * f32(1/448)``, ``data = e4m3(clip(x * (1 / scale), ±448))`` with
an IEEE float32 reciprocal and round-to-nearest-even to e4m3. The CUDA kernels (the quantize
kernel, the normal dispatch's ``use_fp8``, the low-latency send) compute exactly that, each
float32 step correctly rounded, as XLA:CPU does; XLA:GPU's ops put a code one e4m3 step off
in a few elements in a million (its float32 reciprocal is not always the correctly rounded
one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._mesh import abstract_mesh

BLOCK = 128
E4M3_MAX = 448.0
INV_E4M3_MAX = np.float32(1.0 / E4M3_MAX)  # what the CUDA kernel uses: float(1.0 / 448.0)


def quantize_fp8(x, *, ue8m0: bool = False, backend: str = "auto"):
    """[T, H] -> (float8_e4m3fn data [T, H], float32 scales [T, H // 128]).

    backend: ``"auto"`` runs jax_ep's CUDA kernel (one pass over x) where the CUDA backend
    runs and the call is inside ``shard_map`` over every mesh axis (where jax_ep's calls run:
    a custom call outside it would be replicated by XLA's partitioner), else XLA's ops;
    ``"reference"`` XLA's ops; ``"cuda"`` the kernel. The same scales and codes up to XLA:GPU's
    rounding (see the module); gradients are those of XLA's ops.
    """
    if x.ndim != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"quantize_fp8 needs [tokens, hidden] with hidden divisible by {BLOCK}, "
                         f"got {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"quantize_fp8 takes bfloat16, float16 or float32, got {x.dtype}")
    from jax_ep import api  # api imports this module

    resolved = api._resolve_backend(backend)
    if resolved == "cuda" and (backend == "cuda" or _inside_full_shard_map()):
        return _quantize_cuda(x, bool(ue8m0))
    return _quantize_reference(x, ue8m0=bool(ue8m0))


def _inside_full_shard_map() -> bool:
    mesh = abstract_mesh()
    if mesh is None or mesh.empty:
        return False
    every = getattr(mesh, "are_all_axes_manual", None)  # a property from jax 0.7 on
    if every is not None:
        return bool(every)
    return set(getattr(mesh, "manual_axes", ())) == set(mesh.axis_names)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _quantize_cuda(x, ue8m0):
    from jax_ep import _cuda

    return _cuda.quantize_fp8(x, ue8m0=ue8m0)


def _quantize_cuda_fwd(x, ue8m0):
    return _quantize_cuda(x, ue8m0), x


def _quantize_cuda_bwd(ue8m0, x, g):
    return jax.vjp(functools.partial(_quantize_reference, ue8m0=ue8m0), x)[1](g)


_quantize_cuda.defvjp(_quantize_cuda_fwd, _quantize_cuda_bwd)


def _quantize_reference(x, *, ue8m0: bool):
    T, H = x.shape
    blocks = x.astype(jnp.float32).reshape(T, H // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scales = jnp.maximum(amax, jnp.float32(1e-10)) * INV_E4M3_MAX
    if ue8m0:
        # the smallest power of two >= scale, exactly: scale = m * 2^e with m in [0.5, 1), so
        # ceil(log2(scale)) is e - 1 when m == 0.5 and e otherwise (log2 may be inexact)
        # (ldexp may go through pow); built from the exponent bits, exact for every scale
        # here: 2^-43 < 1e-10 / 448 <= scale < 2^120
        mantissa, exponent = jnp.frexp(scales)
        exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent).astype(jnp.int32)
        scales = jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)
    inverse = jnp.float32(1.0) / scales
    data = jnp.clip(blocks * inverse[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return data.reshape(T, H), scales.astype(jnp.float32)


def dequantize_fp8(data, scales, dtype=jnp.float32):
    """Inverse of ``quantize_fp8`` (up to e4m3 rounding): data ``[..., H]``, scales
    ``[..., H // 128]`` (e.g. a low-latency dispatch's ``[L, R*M, H]`` rows)."""
    *lead, H = data.shape
    if scales.shape != (*lead, H // BLOCK):
        raise ValueError(f"scales must be {(*lead, H // BLOCK)}, got {scales.shape}")
    blocks = data.astype(jnp.float32).reshape(*lead, H // BLOCK, BLOCK) * scales[..., None]
    return blocks.reshape(*lead, H).astype(dtype)
