"""benchmarks/bench_moe_layer.py's four ways of running an MoE layer's expert parallelism give
the same loss and gradients as each other and as a dense one-device oracle when nothing drops,
and count what they drop when the capacity is short.

Compiling is what takes the time here: the programs are compiled two at a time with XLA's
cheaper CPU code generation, then run one after the other.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe_layer.py"
_spec = importlib.util.spec_from_file_location("bench_moe_layer", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, bench)  # dataclasses look their module up there
_spec.loader.exec_module(bench)

R, T, H, F, E, K, S = 8, 16, 32, 16, 16, 2, 16
WAYS = "abcd"
TIGHT_WAYS = "cd"  # the drops that this file's code counts (a's and b's are jax_ep's own)
DTYPES = ("float32", "bfloat16")
FAST_COMPILE = {"xla_llvm_disable_expensive_passes": True}
# relative L2 error of every leaf (loss, each gradient) against the oracle / way a
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def setup(dtype, capacity_factor=float(R)):
    """Capacity factor R is the worst case: nothing can drop. bf16 runs the shared expert after
    the combine (the optimization_barrier path), f32 alongside it."""
    return bench.Setup(ranks=R, tokens=T, hidden=H, ffn=F, experts=E, topk=K, shared=S,
                       capacity_factor=capacity_factor, alignment=8, backend="reference",
                       ragged="emulated", shared_overlap=dtype == "float32")


def forward_dropped(s, way, mesh):
    """Rows the way drops, over all ranks, with identity experts (forward only)."""

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(bench.AXIS),) * 3, out_specs=(P(), P()))
    def run(x, topk_idx, gates):
        y, dropped = bench.ROUTED[way](s, x, topk_idx, gates, lambda rows, sizes: rows)
        bad = jnp.sum(~jnp.isfinite(y.astype(jnp.float32)))
        return jax.lax.psum(bad, bench.AXIS), jax.lax.psum(dropped, bench.AXIS)

    return run


@pytest.fixture(scope="module")
def results():
    if jax.device_count() < R:
        pytest.skip(f"needs {R} devices (CPU: 8 fake host devices, see conftest.py)")
    mesh = jax.make_mesh((R,), (bench.AXIS,), devices=jax.devices()[:R],
                         axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    programs = {}
    for dtype in DTYPES:
        s = setup(dtype)
        params = bench.init_params(jax.random.key(0), s, jnp.dtype(dtype))
        x = jax.random.normal(jax.random.key(1), (R * T, H), dtype)
        specs = bench.param_specs(S)
        sharded = ({n: put(v, specs[n]) for n, v in params.items()}, put(x, P(bench.AXIS)))
        oracle = jax.jit(jax.value_and_grad(partial(bench.dense_loss, s), argnums=(0, 1)))
        programs[dtype, "oracle"] = (oracle, (params, x))
        for way in WAYS:
            programs[dtype, way] = (bench.make_step(s, way, mesh), sharded)
    tight = setup("float32", capacity_factor=0.5)
    params = bench.init_params(jax.random.key(0), tight, jnp.float32)
    x = put(jax.random.normal(jax.random.key(1), (R * T, H)), P(bench.AXIS))
    routing = bench.make_routing(tight, mesh)(put(params["router"], P()), x)
    for way in TIGHT_WAYS:
        programs["tight", way] = (jax.jit(forward_dropped(tight, way, mesh)), (x, *routing))
    compiled = bench.compile_all(programs, threads=2, options=FAST_COMPILE)
    table = {}
    for name, (_, args) in programs.items():  # one at a time
        c = compiled[name]
        if isinstance(c, Exception):
            raise c
        out = jax.device_get(c[0](*args))
        if name[0] == "tight":
            table[name] = out  # (non-finite outputs, dropped)
        elif name[1] == "oracle":
            table[name] = (*out, 0)  # (loss, grads, dropped)
        else:
            table[name] = (out[0], out[2], out[1])
    return table


def _rel(a, b):
    a, b = (np.asarray(v, np.float64) for v in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _leaves(loss, grads):
    params, dx = grads
    return {"loss": loss, "d x": dx, **{f"d {n}": v for n, v in params.items()}}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("way", WAYS)
def test_way_matches_oracle_and_way_a(results, dtype, way):
    loss, grads, dropped = results[dtype, way]
    assert int(dropped) == 0
    mine = _leaves(loss, grads)
    for other in ("oracle", "a"):
        theirs = _leaves(*results[dtype, other][:2])
        assert mine.keys() == theirs.keys()
        errors = {n: _rel(mine[n], theirs[n]) for n in mine}
        bad = {n: e for n, e in errors.items() if not e <= TOLERANCE[dtype]}
        assert not bad, f"way {way} vs {other} ({dtype}): relative errors {bad}"
        assert all(np.all(np.isfinite(np.asarray(v, np.float32))) for v in mine.values())


@pytest.mark.parametrize("way", TIGHT_WAYS)
def test_short_capacity_drops_are_counted(results, way):
    not_finite, dropped = results["tight", way]
    assert int(not_finite) == 0
    assert int(dropped) > 0


def test_decode_benchmark_ways_agree():
    """benchmarks/bench_decode_layer.py: a decode layer done by every way gives the same tokens
    (way l's cross in FP8: within its rounding), nothing dropped. One layer: in a second,
    rounding apart could flip a token's top-k."""
    path = _PATH.parent / "bench_decode_layer.py"
    spec = importlib.util.spec_from_file_location("bench_decode_layer", path)
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    ranks = 4
    mesh = jax.make_mesh((ranks,), (bench.AXIS,), devices=jax.devices()[:ranks],
                         axis_types=(jax.sharding.AxisType.Auto,))
    s = bench.Setup(ranks=ranks, tokens=8, hidden=128, ffn=32, experts=16, topk=4,
                    capacity_factor=float(ranks), alignment=1, backend="reference",
                    ragged="emulated", gemm_impl="grouped")
    params = bench.init_params(jax.random.key(0), s, jnp.bfloat16, mesh)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (ranks * 8, 128), jnp.bfloat16),
                       NamedSharding(mesh, P(bench.AXIS)))
    got = {}
    for way in decode.WAYS:
        y, dropped = decode.make_layers(s, way, mesh, 1, "auto")(params, x)
        assert int(dropped) == 0, way
        got[way] = np.asarray(y, np.float32)
    scale = np.abs(got["d"]).max()
    for way, y in got.items():
        tol = 0.05 if way in decode.FP8_WAYS else 0.01  # l: 0.017, c: 0.005 here
        assert np.abs(y - got["d"]).max() <= tol * scale, (way, np.abs(y - got["d"]).max())
