"""Expert feed-forward computations on rows grouped by local expert.

Rows arrive from ``dispatch(..., layout="expert_major")`` grouped by local expert: group ``g``
is rows ``[sum(group_sizes[:g]), sum(group_sizes[:g + 1]))``; rows past ``sum(group_sizes)``
are padding and come out zero. ``sum(group_sizes)`` must not exceed the number of rows.

Grouped matmul implementations (``impl``):

* ``"ragged_dot"``: ``jax.lax.ragged_dot`` and its own autodiff; runs everywhere, but XLA's
  GPU ragged dot is slow and runs out of memory autotuning at DeepSeek-V3 shapes.
* ``"mgpu"``: JAX's Pallas Mosaic-GPU Hopper kernels under a ``jax.custom_vjp``: forward
  ``x @ w[e]`` and ``dx = dy @ w[e]^T`` through ``ragged_dot_mgpu.ragged_dot`` (dx reads
  ``w [L, K, N]`` as ``[L, N_out=K, K_contract=N]`` with ``transpose_rhs=True``: K-major B is
  WGMMA's native operand layout, so no transposed copy of the weights is made), and
  ``dw = x_g^T @ dy_g`` through ``transposed_ragged_dot_mgpu.transposed_ragged_dot``, which
  takes row-major ``x [M, K]`` and ``dy [M, N]`` as they are. bf16/f16 only (WGMMA cannot
  transpose 32-bit operands); the kernels leave rows past ``sum(group_sizes)`` unwritten, so
  they are zeroed here (a ``where`` that XLA fuses into neighbouring elementwise work).
* ``"cuda"``: jax_ep's own kernel (``jax_ep_grouped_matmul``) for few rows per group, as
  decode gives (``low_latency_dispatch(..., layout="expert_major")``): each (group, 128
  output columns) item streams that slice of the expert's weights once per 64 rows and
  multiplies only the group's 16-row tiles, so an empty group costs nothing and the time is
  reading the weights; the tiled kernels above multiply at least one 64- or 128-row tile per
  group. ``sm_count=`` sizes it for the SMs a split low-latency call leaves.
  bf16/f16, K and N multiples of 8; the kernel needs ``mma.sync`` (sm_80 on; the extension
  is built for sm_90 unless its build is given other architectures). Gradients:
  ``dx`` by the same kernel reading w transposed, ``dw`` by ``jax.lax.ragged_dot``'s transpose.
  ``row_index=`` has it read x's rows by index (a ``layout="records"`` dispatch's tokens by
  ``handle.record_rows()``) at no extra cost; the other implementations gather them first.
* ``"auto"`` (default): ``"mgpu"`` on an sm_90 GPU (H100/H200) for bf16/f16 operands whose
  shapes fit some block config, ``"ragged_dot"`` otherwise. Decided at trace time.

``swiglu_mlp_padded`` is the capacity-padded alternative: rows are copied into per-expert
``[L, C, H]`` blocks (overflow dropped and counted), a batched einsum runs at full GEMM rate,
and rows are copied back.

``batched_matmul`` is that batched GEMM as jax_ep's own call (cuBLASLt) sized for a given
number of SMs: XLA's GEMMs are persistent kernels holding every SM, so a jax_ep call beside
one waits for SMs; sized for ``num_sms - Config.num_blocks`` they leave the call its share
(``swiglu_mlp_padded(..., gemm_sms=...)``; docs/design.md §8.1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._mesh import vary_alike

IMPLS = ("auto", "ragged_dot", "mgpu", "cuda")


# ----------------------------------------------------------------------------- configs


class GemmConfig(NamedTuple):
    """Block config of one Mosaic-GPU ragged GEMM (the kernels' keyword arguments).

    fwd/dx (``ragged_dot``): block_m over rows, block_n over output columns, block_k over the
    contraction. dw (``transposed_ragged_dot``): block_m over K, block_n over N, block_k over
    rows (the ragged contraction).
    """

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int


class GemmConfigs(NamedTuple):
    """The three kernels' configs of one grouped matmul ``x [M, K] @ w [L, K, N]``."""

    fwd: GemmConfig
    dx: GemmConfig
    dw: GemmConfig


# (pass, K, N) of w [L, K, N] -> config; measured on an H100 (bench_expert_gemm.py --sweep).
TUNED_CONFIGS: dict[tuple[str, int, int], GemmConfig] = {
    ("fwd", 7168, 2048): GemmConfig(128, 128, 64, 4, 4),
    ("dx", 7168, 2048): GemmConfig(128, 128, 64, 5, 4),
    ("dw", 7168, 2048): GemmConfig(128, 128, 64, 4, 2),
    ("fwd", 2048, 7168): GemmConfig(128, 128, 128, 2, 4),
    ("dx", 2048, 7168): GemmConfig(128, 128, 64, 3, 4),
    ("dw", 2048, 7168): GemmConfig(128, 128, 64, 4, 2),
}

_SMEM_BYTES = 227 * 1024  # per-block shared memory on sm_90


def _smem_bytes(cfg: GemmConfig, itemsize: int) -> int:
    step = (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize
    return cfg.max_concurrent_steps * step + cfg.block_m * cfg.block_n * itemsize


def config_fits(kind: str, cfg: GemmConfig, m: int, k: int, n: int, itemsize: int = 2) -> bool:
    """Whether ``cfg`` can run pass ``kind`` of ``x [m, k] @ w [L, k, n]`` (divisibility the
    kernels need, shared memory)."""
    if _smem_bytes(cfg, itemsize) > _SMEM_BYTES or cfg.max_concurrent_steps < 1:
        return False
    if cfg.block_m % 64 or cfg.block_n % 64 or cfg.block_k % 64 or m <= 0:
        return False
    if kind == "fwd":
        rows, out, red = m, n, k
    elif kind == "dx":
        rows, out, red = m, k, n
    elif kind == "dw":  # kernel m = K, n = N, k = rows
        return k % cfg.block_m == 0 and n % cfg.block_n == 0 and m % cfg.block_k == 0
    else:
        raise ValueError(f"unknown pass {kind!r}")
    return rows % cfg.block_m == 0 and out % cfg.block_n == 0 and red % cfg.block_k == 0


def _heuristic_config(kind: str, m: int, k: int, n: int) -> GemmConfig:
    def block(dim):
        return 128 if dim % 128 == 0 else 64

    if kind == "fwd":
        bm, bn = block(m), block(n)
    elif kind == "dx":
        bm, bn = block(m), block(k)
    else:
        bm, bn = block(k), block(n)
    return GemmConfig(bm, bn, 64, 4, 4)


def select_configs(m: int, k: int, n: int, itemsize: int = 2,
                 overrides=None) -> GemmConfigs | None:
    """Configs for ``x [m, k] @ w [L, k, n]``: ``overrides`` (same keys as
    ``TUNED_CONFIGS``), then the tuned table, then a heuristic; None when no config fits."""
    picked = []
    for kind in GemmConfigs._fields:
        key = (kind, k, n)
        candidates = [c for c in ((overrides or {}).get(key), TUNED_CONFIGS.get(key),
                                  _heuristic_config(kind, m, k, n)) if c is not None]
        cfg = next((c for c in candidates if config_fits(kind, c, m, k, n, itemsize)), None)
        if cfg is None:
            return None
        picked.append(cfg)
    return GemmConfigs(*picked)


# ----------------------------------------------------------------------------- kernels


def _mgpu_ragged_dot(lhs, rhs, group_sizes, cfg: GemmConfig, transpose_rhs: bool):
    """lhs [M, K'] @ rhs[g] ([L, K', N'] or, transposed, [L, N', K']) -> [M, N'] in lhs'
    dtype; rows past sum(group_sizes) are left unwritten."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes,
                                      transpose_rhs=transpose_rhs, **cfg._asdict())


def _mgpu_transposed_ragged_dot(lhs, rhs, group_sizes, cfg: GemmConfig):
    """lhs [M, K], rhs [M, N] -> [L, K, N]: lhs_g^T @ rhs_g per group (zero for empty ones)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs, rhs, group_sizes=group_sizes, **cfg._asdict())


class _Kernels(NamedTuple):
    """The grouped-GEMM primitives the custom_vjp is built from (swappable for tests)."""

    ragged_dot: Callable
    transposed_ragged_dot: Callable
    dtypes: tuple


_MGPU_KERNELS = _Kernels(_mgpu_ragged_dot, _mgpu_transposed_ragged_dot,
                         (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


@functools.cache
def _is_hopper_gpu() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    try:  # the Mosaic-GPU Pallas backend ships with the CUDA plugin
        from jax.experimental.pallas.ops.gpu import (  # noqa: F401
            ragged_dot_mgpu,
            transposed_ragged_dot_mgpu,
        )
    except ImportError:
        return False
    cc = str(getattr(dev, "compute_capability", ""))  # "9.0" on H100/H200
    if cc:
        return cc == "9.0"
    kind = dev.device_kind.upper()
    return any(name in kind for name in ("H100", "H200", "H800", "H20"))


# ----------------------------------------------------------------------------- grouped matmul


def _zero_padding_rows(y, group_sizes):
    keep = jnp.arange(y.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes)
    return jnp.where(keep[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _custom_gmm(x, w, group_sizes, kernels: _Kernels, cfgs: GemmConfigs):
    y = kernels.ragged_dot(x, w, group_sizes, cfgs.fwd, False)
    return _zero_padding_rows(y, group_sizes)


def _custom_gmm_fwd(x, w, group_sizes, kernels, cfgs):
    return _custom_gmm(x, w, group_sizes, kernels, cfgs), (x, w, group_sizes)


def _custom_gmm_bwd(kernels, cfgs, res, dy):
    x, w, group_sizes = res
    dy = _zero_padding_rows(dy.astype(x.dtype), group_sizes)  # dw reads a few padding rows
    dx = _zero_padding_rows(kernels.ragged_dot(dy, w, group_sizes, cfgs.dx, True), group_sizes)
    dw = kernels.transposed_ragged_dot(x, dy, group_sizes, cfgs.dw).astype(w.dtype)
    # the Pallas kernels' results are typed invariant over the mesh axes: the cotangents must
    # vary as their inputs do
    dx, _ = vary_alike(dx, x)
    dw, _ = vary_alike(dw, w)
    return dx, dw, None


_custom_gmm.defvjp(_custom_gmm_fwd, _custom_gmm_bwd)


def _gather_rows(x, row_index):
    """x[row_index] with rows of zeros where the index is outside x's rows."""
    valid = (row_index >= 0) & (row_index < x.shape[0])
    rows = x[jnp.clip(row_index, 0, x.shape[0] - 1)]
    return jnp.where(valid[:, None], rows, jnp.zeros((), x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cuda_gmm(x, w, group_sizes, row_index, sms=0):
    from jax_ep import _cuda

    return _cuda.grouped_matmul(x, w, group_sizes, transpose_w=False, sm_count=sms,
                                row_index=row_index)


def _cuda_gmm_fwd(x, w, group_sizes, row_index, sms):
    return _cuda_gmm(x, w, group_sizes, row_index, sms), (x, w, group_sizes, row_index)


def _cuda_gmm_bwd(sms, res, dy):
    from jax_ep import _cuda

    x, w, group_sizes, row_index = res
    dy = _zero_padding_rows(dy.astype(x.dtype), group_sizes)
    dx = _cuda.grouped_matmul(dy, w, group_sizes, transpose_w=True, sm_count=sms)  # dy @ w^T
    x_rows = x
    if row_index is not None:  # each gathered row's cotangent back to its x row
        x_rows = _gather_rows(x, row_index)
        valid = (row_index >= 0) & (row_index < x.shape[0])
        dx = jnp.zeros(x.shape, jnp.float32).at[jnp.where(valid, row_index, x.shape[0])].add(
            dx.astype(jnp.float32), mode="drop").astype(x.dtype)
    _, w_vjp = jax.vjp(lambda w_: jax.lax.ragged_dot(x_rows, w_, group_sizes), w)
    (dw,) = w_vjp(dy)
    dx, _ = vary_alike(dx, x)
    dw, _ = vary_alike(dw.astype(w.dtype), w)
    return dx, dw, None, None


_cuda_gmm.defvjp(_cuda_gmm_fwd, _cuda_gmm_bwd)


def _choose(impl, x, w, overrides=None):
    """(impl actually used, configs or None)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "ragged_dot":
        return "ragged_dot", None
    if impl == "cuda":
        ok = (x.ndim == 2 and w.ndim == 3 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
              and jnp.dtype(x.dtype) in _MGPU_KERNELS.dtypes and x.shape[1] % 8 == 0
              and w.shape[2] % 8 == 0)
        if not ok:
            raise ValueError(f"impl='cuda' cannot take x {x.shape} {x.dtype} @ w {w.shape} "
                             f"{w.dtype}: needs equal bf16/f16 dtypes and K, N that are "
                             "multiples of 8")
        if not _native_gemm_available():
            raise RuntimeError("impl='cuda' needs the CUDA extension and a GPU")
        return "cuda", None
    m, k = x.shape
    _, k2, n = w.shape
    dtype_ok = x.dtype == w.dtype and jnp.dtype(x.dtype) in _MGPU_KERNELS.dtypes and k == k2
    cfgs = select_configs(m, k, n, jnp.dtype(x.dtype).itemsize, overrides) if dtype_ok else None
    if impl == "mgpu":
        if cfgs is None:
            raise ValueError(f"impl='mgpu' cannot take x {x.shape} {x.dtype} @ w {w.shape} "
                             f"{w.dtype}: needs equal bf16/f16 dtypes and rows, K, N that "
                             "are multiples of 64")
        return "mgpu", cfgs
    if cfgs is not None and _is_hopper_gpu():
        return "mgpu", cfgs
    return "ragged_dot", None


def grouped_matmul(x, w, group_sizes, *, impl="auto", mgpu_configs=None, sm_count=None,
                   row_index=None):
    """``x [M, K]`` rows grouped by expert times ``w [L, K, N]`` -> ``[M, N]`` in x's dtype,
    accumulated in float32; rows past ``sum(group_sizes)`` are zero.

    impl: ``"auto"``, ``"ragged_dot"``, ``"mgpu"`` or ``"cuda"`` (see the module docstring).
    mgpu_configs: optional ``{(pass, K, N): GemmConfig}`` overriding ``TUNED_CONFIGS``.
    sm_count: ``impl="cuda"`` only: the SMs its kernel takes (None or 0: every SM), i.e. what
    a split low-latency call beside it leaves (``low_latency_split_gemm_sms``).
    row_index: optional ``[P]`` int32: the grouped rows are ``x[row_index]`` (an index
    outside x's rows reads zeros) and the result ``[P, N]``; ``impl="cuda"`` reads them by
    index in its loads, the others gather first. A records low-latency dispatch's x with
    ``handle.record_rows()``.
    """
    if row_index is not None:
        if row_index.ndim != 1 or not jnp.issubdtype(row_index.dtype, jnp.integer):
            raise ValueError(f"row_index must be a 1-D integer array, got {row_index.shape} "
                             f"{row_index.dtype}")
        row_index = row_index.astype(jnp.int32)
        if impl != "cuda":  # the others multiply the gathered rows
            return grouped_matmul(_gather_rows(x, row_index), w, group_sizes, impl=impl,
                                  mgpu_configs=mgpu_configs, sm_count=sm_count)
    used, cfgs = _choose(impl, x, w, overrides=mgpu_configs)
    sms = 0 if sm_count is None else sm_count
    if isinstance(sms, bool) or not isinstance(sms, (int, np.integer)) or sms < 0:
        raise ValueError(f"sm_count must be None or a count of SMs >= 0, got {sm_count!r}")
    if sms and used != "cuda":
        raise ValueError(f"sm_count sizes impl='cuda' only (this call runs {used!r})")
    group_sizes = group_sizes.astype(jnp.int32)
    if used == "mgpu":
        return _custom_gmm(*vary_alike(x, w, group_sizes), _MGPU_KERNELS, cfgs)
    if used == "cuda":
        if row_index is None:
            return _cuda_gmm(*vary_alike(x, w, group_sizes), None, int(sms))
        return _cuda_gmm(*vary_alike(x, w, group_sizes, row_index), int(sms))
    return jax.lax.ragged_dot(x, w, group_sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)


def swiglu_mlp(rows, w_gate, w_up, w_down, group_sizes, *, impl="auto", mgpu_configs=None,
               sm_count=None, row_index=None):
    """SwiGLU experts: ``(silu(rows @ w_gate[e]) * (rows @ w_up[e])) @ w_down[e]`` per group.

    rows [M, H]; w_gate, w_up [L, H, F]; w_down [L, F, H] -> [M, H] in rows' dtype.
    impl, mgpu_configs, sm_count, row_index: as in ``grouped_matmul`` (with row_index the
    result has its P rows).
    """
    gmm = functools.partial(grouped_matmul, group_sizes=group_sizes, impl=impl,
                            mgpu_configs=mgpu_configs, sm_count=sm_count)
    gate = gmm(rows, w_gate, row_index=row_index)
    up = gmm(rows, w_up, row_index=row_index)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(rows.dtype)
    return gmm(h, w_down)


def dense_swiglu(x, w_gate, w_up, w_down):
    """Every expert on every row (the oracle): x [T, H] -> [T, L, H] float32."""
    gate = jnp.einsum("th,lhf->tlf", x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("th,lhf->tlf", x, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate) * up).astype(x.dtype)
    return jnp.einsum("tlf,lfh->tlh", h, w_down, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- padded path


def _padded_index(group_sizes, rows_per_expert, capacity):
    """Flat row index of each [L, C] slot and whether the slot holds a row."""
    starts = jnp.cumsum(group_sizes) - group_sizes
    slot = jnp.arange(capacity, dtype=jnp.int32)
    valid = slot[None, :] < jnp.minimum(rows_per_expert, group_sizes)[:, None]
    return starts[:, None] + slot[None, :], valid


def _gather_to_padded(x, group_sizes, rows_per_expert, capacity):
    idx, valid = _padded_index(group_sizes, rows_per_expert, capacity)
    xp = jnp.take(x, idx.reshape(-1), axis=0, mode="clip").reshape(*idx.shape, x.shape[1])
    return jnp.where(valid[..., None], xp, jnp.zeros((), x.dtype))


def _gather_from_padded(yp, group_sizes, rows_per_expert, num_rows):
    num_experts, capacity, _ = yp.shape
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.sum(row[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)  # L if padding
    e = jnp.minimum(expert, num_experts - 1)
    pos = row - (ends[e] - group_sizes[e])
    valid = (expert < num_experts) & (pos < jnp.minimum(rows_per_expert[e], capacity))
    y = jnp.take(yp.reshape(num_experts * capacity, -1), e * capacity + pos, axis=0,
                 mode="clip")
    return jnp.where(valid[:, None], y, jnp.zeros((), yp.dtype))


# The two copies are partial permutations transposed to each other: each one's VJP is the
# other (gathers only; XLA's default transpose of a gather is a slower scatter-add).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _to_padded(x, group_sizes, rows_per_expert, capacity):
    return _gather_to_padded(x, group_sizes, rows_per_expert, capacity)


def _to_padded_fwd(x, group_sizes, rows_per_expert, capacity):
    return (_gather_to_padded(x, group_sizes, rows_per_expert, capacity),
            (group_sizes, rows_per_expert, x.shape[0]))


def _to_padded_bwd(capacity, res, dxp):
    group_sizes, rows_per_expert, num_rows = res
    return _from_padded(dxp, group_sizes, rows_per_expert, num_rows), None, None


_to_padded.defvjp(_to_padded_fwd, _to_padded_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _from_padded(yp, group_sizes, rows_per_expert, num_rows):
    return _gather_from_padded(yp, group_sizes, rows_per_expert, num_rows)


def _from_padded_fwd(yp, group_sizes, rows_per_expert, num_rows):
    return (_gather_from_padded(yp, group_sizes, rows_per_expert, num_rows),
            (group_sizes, rows_per_expert, yp.shape[1]))


def _from_padded_bwd(num_rows, res, dy):
    group_sizes, rows_per_expert, capacity = res
    return _to_padded(dy, group_sizes, rows_per_expert, capacity), None, None


_from_padded.defvjp(_from_padded_fwd, _from_padded_bwd)


def _rows_per_expert(group_sizes, rows_per_expert):
    group_sizes = group_sizes.astype(jnp.int32)
    if rows_per_expert is None:
        return group_sizes, group_sizes
    return group_sizes, rows_per_expert.astype(jnp.int32)


def to_padded(x, group_sizes, capacity, *, rows_per_expert=None):
    """expert_major rows ``x [M, H]`` -> ``([L, C, H], num_overflow)``, C = ``capacity``.

    Slot ``[e, c]`` holds row ``start[e] + c`` for ``c < min(rows_per_expert[e], C)`` and zero
    otherwise. ``rows_per_expert`` (default ``group_sizes``) is how many leading rows of each
    group are real, e.g. ``DispatchOutput.tokens_per_expert``, so alignment padding is neither
    copied nor counted. num_overflow: [] int32 real rows that did not fit (dropped).
    """
    group_sizes, rows_per_expert = _rows_per_expert(group_sizes, rows_per_expert)
    overflow = jnp.sum(jnp.maximum(rows_per_expert - capacity, 0))
    x, group_sizes, rows_per_expert = vary_alike(x, group_sizes, rows_per_expert)
    return _to_padded(x, group_sizes, rows_per_expert, int(capacity)), overflow


def from_padded(yp, group_sizes, num_rows, *, rows_per_expert=None):
    """Inverse of ``to_padded``: ``[L, C, H]`` -> expert_major ``[num_rows, H]``; rows that
    were not copied in (overflow, alignment and trailing padding) come out zero."""
    group_sizes, rows_per_expert = _rows_per_expert(group_sizes, rows_per_expert)
    yp, group_sizes, rows_per_expert = vary_alike(yp, group_sizes, rows_per_expert)
    return _from_padded(yp, group_sizes, rows_per_expert, int(num_rows))


# ----------------------------------------------------------------------------- batched GEMM


def batched_matmul(x, w, *, sm_count=None, preferred_element_type=None, precision=None,
                   backend="auto"):
    """Per expert ``x[l] @ w[l]``: x ``[L, M, K]``, w ``[L, K, N]`` -> ``[L, M, N]``, float32
    accumulation.

    sm_count: the SMs the GEMM kernel is sized for on the CUDA backend (None or 0: every SM),
    i.e. what a jax_ep call running beside it leaves: ``num_sms - Config.num_blocks``.
    preferred_element_type: the result's dtype (default x's).
    precision: float32 operands: ``"highest"`` / ``"float32"`` (or ``jax.lax.Precision.
    HIGHEST``) multiplies them in float32, anything else rounds them to TF32 as XLA's GPU dots
    do at default precision; None: ``jax.default_matmul_precision``'s.
    backend: ``"auto"`` runs jax_ep's cuBLASLt call inside ``shard_map`` over every mesh axis
    where the CUDA extension and a GPU are present (a custom call outside it would be
    replicated by XLA's partitioner), else ``jnp.einsum``; ``"cuda"`` the call;
    ``"reference"`` the einsum. Gradients: the same call, transposed operands.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(f"batched_matmul needs x [L, M, K] and w [L, K, N], got {x.shape} and "
                         f"{w.shape}")
    kinds = (jnp.bfloat16, jnp.float16, jnp.float32)
    if x.dtype not in kinds or w.dtype != x.dtype:
        raise TypeError(f"batched_matmul takes bfloat16, float16 or float32 operands of one "
                        f"dtype, got {x.dtype} and {w.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if out_dtype not in kinds:
        raise TypeError(f"batched_matmul's result must be bfloat16, float16 or float32, got "
                        f"{out_dtype}")
    sms = 0 if sm_count is None else sm_count
    if isinstance(sms, bool) or not isinstance(sms, (int, np.integer)) or sms < 0:
        raise ValueError(f"sm_count must be None or a count of SMs >= 0, got {sm_count!r}")
    if backend not in ("auto", "cuda", "reference"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'reference', got {backend!r}")
    if backend == "auto":
        from jax_ep.fp8 import _inside_full_shard_map

        backend = "cuda" if _native_gemm_available() and _inside_full_shard_map() else "reference"
    if backend == "reference":
        return jnp.einsum("lmk,lkn->lmn", x, w, precision=precision,
                          preferred_element_type=jnp.float32).astype(out_dtype)
    if not _native_gemm_available():
        raise RuntimeError("backend='cuda' needs the CUDA extension and a GPU")
    return _cuda_gemm(x, w, int(sms), out_dtype, _tf32(precision))


def _tf32(precision) -> bool:
    """Whether float32 operands may be rounded to TF32 (XLA's GPU dots at default
    precision): not where the precision, or jax's default one, asks for float32."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, (tuple, list)):
        precision = max(precision, key=lambda p: jax.lax.Precision(p).value)
    if precision is None:
        return True
    return jax.lax.Precision(precision) != jax.lax.Precision.HIGHEST


def _native_gemm_available() -> bool:
    from jax_ep import _native

    return _native.load()[0] is not None and _native.gpu_present()


def _gemm(a, b, trans_a, trans_b, sms, out_dtype, tf32):
    from jax_ep import _cuda

    return _cuda.batched_matmul(a, b, trans_a=trans_a, trans_b=trans_b, sm_count=sms,
                                out_dtype=out_dtype, tf32=tf32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _cuda_gemm(x, w, sms, out_dtype, tf32):
    return _gemm(x, w, False, False, sms, out_dtype, tf32)


def _cuda_gemm_fwd(x, w, sms, out_dtype, tf32):
    return _cuda_gemm(x, w, sms, out_dtype, tf32), (x, w)


def _cuda_gemm_bwd(sms, out_dtype, tf32, res, dy):
    x, w = res
    dy = dy.astype(x.dtype)  # cuBLASLt takes operands of one type, as einsum's transpose does
    dx = _gemm(dy, w, False, True, sms, x.dtype, tf32)   # dy [L, M, N] @ w^T [L, N, K]
    dw = _gemm(x, dy, True, False, sms, w.dtype, tf32)   # x^T [L, K, M] @ dy [L, M, N]
    return dx, dw


_cuda_gemm.defvjp(_cuda_gemm_fwd, _cuda_gemm_bwd)


def swiglu_mlp_padded(rows, w_gate, w_up, w_down, group_sizes, *, capacity,
                      rows_per_expert=None, gemm_sms=None):
    """``swiglu_mlp`` through per-expert ``[L, capacity, H]`` blocks and batched GEMMs.

    gemm_sms: None: XLA's batched einsums; an SM count (0: every SM): ``batched_matmul`` sized
    for that many SMs, to leave the rest to a jax_ep call running beside it.
    Returns ``(out [M, H], num_overflow)``: rows past an expert's capacity are dropped (zero
    output, zero gradient) and counted.
    """
    xp, overflow = to_padded(rows, group_sizes, capacity, rows_per_expert=rows_per_expert)
    if gemm_sms is None:
        def mm(a, b):
            return jnp.einsum("lch,lhf->lcf", a, b)
    else:
        def mm(a, b):
            return batched_matmul(a, b, sm_count=gemm_sms)
    gate = mm(xp, w_gate)
    up = mm(xp, w_up)
    h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(rows.dtype)
    yp = mm(h, w_down)
    out = from_padded(yp, group_sizes, rows.shape[0], rows_per_expert=rows_per_expert)
    return out, overflow
