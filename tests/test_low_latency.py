"""Low-latency (decode) mode on the reference backend against the NumPy oracle and a dense MoE."""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe

import oracle
from ep import AXIS, mesh, run
from test_reference import make_inputs


def ll_dispatch(x, idx, E, M, use_fp8, split=False, layout="blocks"):
    def fn(x, idx):
        kw = dict(num_experts=E, max_tokens_per_rank=M, axis_name=AXIS, use_fp8=use_fp8,
                  backend="reference", layout=layout)
        if split:
            pending = jax_ep.low_latency_dispatch_send(x, idx, **kw)
            return jax_ep.low_latency_dispatch_receive(pending)
        return jax_ep.low_latency_dispatch(x, idx, **kw)

    return run(fn, x.shape[0], x, idx)


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("R,T,M,H,K,E,kind,mask", [
    (1, 4, 4, 128, 2, 3, "random", 0.0),
    (2, 8, 8, 256, 8, 16, "random", 0.2),
    (4, 5, 7, 128, 3, 12, "random", 0.3),
    (4, 6, 6, 128, 4, 8, "one_expert", 0.0),
    (8, 3, 4, 128, 8, 24, "random", 0.1),
])
def test_low_latency_dispatch_matches_oracle(R, T, M, H, K, E, kind, mask, use_fp8):
    rng = np.random.default_rng(R * 7 + K)
    x, idx, _ = make_inputs(rng, R, T, H, K, E, kind, mask, dtype=jnp.bfloat16)
    out = ll_dispatch(x, idx, E, M, use_fp8)
    if use_fp8:
        data, scales = jax.vmap(jax_ep.quantize_fp8)(jnp.asarray(x))
        payload = np.asarray(data).view(np.uint8)
        got_x = np.asarray(out.x).view(np.uint8)
    else:
        payload, got_x = x, np.asarray(out.x)
    want, slot = oracle.low_latency_dispatch(payload, idx, E, M)
    L = E // R
    assert out.x.shape == (R, L, R * M, H)
    for r in range(R):
        np.testing.assert_array_equal(got_x[r], want[r]["x"], err_msg=f"rank {r} x")
        for name in ("recv_count", "num_dropped"):
            np.testing.assert_array_equal(getattr(out, name)[r], want[r][name])
        for name in ("src_rank", "src_token", "src_k", "pair_row"):
            np.testing.assert_array_equal(getattr(out.handle, name)[r], want[r][name])
        if use_fp8:
            want_scales, _ = oracle.low_latency_dispatch(np.asarray(scales), idx, E, M)
            np.testing.assert_array_equal(out.x_scales[r], want_scales[r]["x"])
    np.testing.assert_array_equal(out.handle.send_slot, slot)
    split = ll_dispatch(x, idx, E, M, use_fp8, split=True)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(split)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("R,T,M,H,K,E,kind,mask", [
    (1, 4, 4, 128, 2, 3, "random", 0.0),
    (2, 8, 8, 256, 8, 16, "random", 0.2),
    (4, 5, 7, 128, 3, 12, "random", 0.3),
    (4, 6, 6, 128, 4, 8, "one_expert", 0.0),  # top-k above the 2 local experts
])
def test_low_latency_expert_major_matches_oracle(R, T, M, H, K, E, kind, mask, use_fp8, split):
    """layout="expert_major": the blocks' used rows packed by local expert into
    R*M*min(K, L) rows, the handle's rows and pair_row renumbered to match."""
    rng = np.random.default_rng(R * 5 + K)
    x, idx, _ = make_inputs(rng, R, T, H, K, E, kind, mask, dtype=jnp.bfloat16)
    out = ll_dispatch(x, idx, E, M, use_fp8, split=split, layout="expert_major")
    if use_fp8:
        data, scales = jax.vmap(jax_ep.quantize_fp8)(jnp.asarray(x))
        payload, got_x = np.asarray(data).view(np.uint8), np.asarray(out.x).view(np.uint8)
    else:
        payload, got_x = x, np.asarray(out.x)
    want, slot = oracle.low_latency_dispatch(payload, idx, E, M)
    L = E // R
    assert out.x.shape == (R, R * M * min(K, L), H)
    for r in range(R):
        packed = oracle.low_latency_packed(want[r], K)
        np.testing.assert_array_equal(got_x[r], packed["x"], err_msg=f"rank {r} x")
        for name in ("recv_count", "num_dropped"):
            np.testing.assert_array_equal(getattr(out, name)[r], packed[name])
        for name in ("src_rank", "src_token", "src_k", "pair_row"):
            np.testing.assert_array_equal(getattr(out.handle, name)[r], packed[name],
                                          err_msg=f"rank {r} {name}")
        if use_fp8:
            want_scales, _ = oracle.low_latency_dispatch(np.asarray(scales), idx, E, M)
            np.testing.assert_array_equal(out.x_scales[r],
                                          oracle.low_latency_packed(want_scales[r], K)["x"])
    np.testing.assert_array_equal(out.handle.send_slot, slot)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("R,T,M,H,K,E,kind,mask", [
    (1, 4, 4, 128, 2, 3, "random", 0.0),
    (2, 8, 8, 256, 8, 16, "random", 0.2),
    (4, 5, 7, 128, 3, 12, "random", 0.3),  # M > T: rows past a source's tokens
    (4, 6, 6, 128, 4, 8, "one_expert", 0.0),
])
def test_low_latency_records_match_oracle(R, T, M, H, K, E, kind, mask, use_fp8, split):
    """layout="records": each token that has a pair here once, at row s*M + t; the handle is
    expert_major's, and the records read by handle.record_rows() are expert_major's rows."""
    rng = np.random.default_rng(R * 3 + K)
    x, idx, _ = make_inputs(rng, R, T, H, K, E, kind, mask, dtype=jnp.bfloat16)
    out = ll_dispatch(x, idx, E, M, use_fp8, split=split, layout="records")
    packed_out = ll_dispatch(x, idx, E, M, use_fp8, layout="expert_major")
    if use_fp8:
        data, scales = jax.vmap(jax_ep.quantize_fp8)(jnp.asarray(x))
        payload, got_x = np.asarray(data).view(np.uint8), np.asarray(out.x).view(np.uint8)
    else:
        payload, got_x = np.asarray(x), np.asarray(out.x)
    want, slot = oracle.low_latency_dispatch(payload, idx, E, M)
    assert out.x.shape == (R, R * M, H)
    record_rows = np.asarray(jax.vmap(lambda h: h.record_rows())(out.handle))
    for r in range(R):
        packed = oracle.low_latency_packed(want[r], K)
        np.testing.assert_array_equal(got_x[r], oracle.low_latency_records(packed, payload, M),
                                      err_msg=f"rank {r} x")
        for name in ("src_rank", "src_token", "src_k", "pair_row"):
            np.testing.assert_array_equal(getattr(out.handle, name)[r], packed[name],
                                          err_msg=f"rank {r} {name}")
        np.testing.assert_array_equal(out.recv_count[r], packed["recv_count"])
        rows = record_rows[r]
        used = rows >= 0
        np.testing.assert_array_equal(got_x[r][rows[used]],
                                      np.asarray(packed_out.x[r]).view(got_x.dtype)[used])
        if use_fp8:
            np.testing.assert_array_equal(
                out.x_scales[r], oracle.low_latency_records(packed, np.asarray(scales), M))
    np.testing.assert_array_equal(out.handle.send_slot, slot)


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_expert_major_combine_matches_oracle(split):
    """The combine reads the packed rows through the handle; rows past the used ones (random
    here) are never read."""
    R, T, M, H, K, E = 4, 6, 8, 64, 4, 16
    rng = np.random.default_rng(6)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    L = E // R
    y = rng.standard_normal((R, R * M * min(K, L), H)).astype(np.float32)

    def fn(x, idx, w, y):
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                        axis_name=AXIS, use_fp8=False, backend="reference",
                                        layout="expert_major")
        if split:
            out = jax_ep.low_latency_combine_receive(
                jax_ep.low_latency_combine_send(y, w, o.handle), o.handle)
        else:
            out = jax_ep.low_latency_combine(y, w, o.handle)
        return out, o.recv_count

    got, counts = run(fn, R, x, idx, w, y)
    blocks = np.stack([oracle.low_latency_unpacked(y[r], np.asarray(counts[r]), R * M)
                       for r in range(R)])
    np.testing.assert_array_equal(got, oracle.low_latency_combine(blocks, w, idx, E, M))


@pytest.mark.parametrize("split,dtype", [(False, np.float32), (True, np.float32),
                                         (False, jnp.bfloat16)])
def test_low_latency_combine_matches_oracle(split, dtype):
    """bfloat16 y: every rank's partial is rounded to bfloat16 before the owner adds them."""
    R, T, M, H, K, E = 4, 6, 8, 64, 4, 16
    rng = np.random.default_rng(4)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    L = E // R
    y = rng.standard_normal((R, L, R * M, H)).astype(dtype)

    def fn(x, idx, w, y):
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                        axis_name=AXIS, use_fp8=False, backend="reference")
        if split:
            pending = jax_ep.low_latency_combine_send(y, w, o.handle)
            return jax_ep.low_latency_combine_receive(pending, o.handle), o.handle.send_slot
        return jax_ep.low_latency_combine(y, w, o.handle), o.handle.send_slot

    got, slot = run(fn, R, x, idx, w, y)
    np.testing.assert_array_equal(got, oracle.low_latency_combine(y, w, idx, E, M))


@pytest.mark.parametrize("layout,axis_type", [("blocks", "Auto"), ("blocks", "Explicit"),
                                              ("expert_major", "Auto"), ("records", "Auto")])
def test_low_latency_decode_block_and_grads_match_dense(layout, axis_type):
    """Explicit: jax.make_mesh's default axis type (jax 0.7 on), under the mesh context that
    explicit sharding asks of programs. expert_major: the packed rows straight into grouped
    GEMMs (recv_count the group sizes); records: the same GEMMs reading the records by the
    handle's index."""
    from jax_ep import experts

    if axis_type == "Explicit" and not hasattr(jax, "set_mesh"):
        pytest.skip("this jax has no jax.set_mesh")
    R, T, M, H, F, E = 4, 6, 8, 16, 12, 8
    K = 2 if layout == "blocks" else 3
    key = jax.random.key(3)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = dict(router=jax.random.normal(k1, (H, E)),
                  w_in=jax.random.normal(k2, (E, H, F)) / np.sqrt(H),
                  w_out=jax.random.normal(k3, (E, F, H)) / np.sqrt(F))
    x = jax.random.normal(k4, (R * T, H))
    m = mesh(R, axis_type=axis_type)
    specs = dict(router=P(), w_in=P(AXIS), w_out=P(AXIS))

    @jax.jit
    @partial(jax.shard_map, mesh=m, in_specs=(specs, P(AXIS)), out_specs=P())
    def ep_loss(p, x):
        idx, gates = moe.route(x, p["router"], K)
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=M,
                                        axis_name=AXIS, use_fp8=False, backend="reference",
                                        layout=layout)
        if layout == "blocks":
            h = jax.nn.gelu(jnp.einsum("lrh,lhf->lrf", o.x, p["w_in"]))
            y = jnp.einsum("lrf,lfh->lrh", h, p["w_out"])
        else:
            mm = partial(experts.grouped_matmul, group_sizes=o.recv_count, impl="ragged_dot")
            index = o.handle.record_rows() if layout == "records" else None
            y = mm(jax.nn.gelu(mm(o.x, p["w_in"], row_index=index)), p["w_out"])
        out = jax_ep.low_latency_combine(y, gates, o.handle)
        return jax.lax.psum(jnp.sum(jnp.sin(out)), AXIS)

    def dense_loss(p, x):
        return jnp.sum(jnp.sin(moe.dense_moe_block(x, p["router"], p["w_in"], p["w_out"],
                                                   top_k=K)))

    put = lambda a, s: jax.device_put(a, NamedSharding(m, s))  # noqa: E731
    pp = {k: put(v, specs[k]) for k, v in params.items()}
    xp = put(x, P(AXIS))
    with jax.set_mesh(m) if axis_type == "Explicit" else contextlib.nullcontext():
        np.testing.assert_allclose(ep_loss(pp, xp), dense_loss(params, x), rtol=1e-5)
        got = jax.grad(ep_loss, argnums=(0, 1))(pp, xp)
    want = jax.grad(dense_loss, argnums=(0, 1))(params, x)
    for name in params:
        np.testing.assert_allclose(got[0][name], want[0][name], rtol=2e-4, atol=2e-5,
                                   err_msg=name)
    np.testing.assert_allclose(got[1], want[1], rtol=2e-4, atol=2e-5)


def test_low_latency_validation():
    R = 2

    def attempt(T=4, M=4, H=128, use_fp8=True, layout="blocks"):
        def fn(x, idx):
            return jax_ep.low_latency_dispatch(x, idx, num_experts=4, max_tokens_per_rank=M,
                                               axis_name=AXIS, use_fp8=use_fp8,
                                               backend="reference", layout=layout).x

        run(fn, R, np.ones((R, T, H), np.float32), np.zeros((R, T, 2), np.int32))

    def combine(layout, y_layout):  # y in y_layout's shape for a dispatch in layout's
        def fn(x, idx):
            kw = dict(num_experts=4, max_tokens_per_rank=4, axis_name=AXIS, use_fp8=False,
                      backend="reference")
            o = jax_ep.low_latency_dispatch(x, idx, layout=layout, **kw)
            y = jax_ep.low_latency_dispatch(x, idx, layout=y_layout, **kw).x
            return jax_ep.low_latency_combine(y, jnp.ones(idx.shape), o.handle)

        run(fn, R, np.ones((R, 4, 128), np.float32), np.zeros((R, 4, 2), np.int32))

    with pytest.raises(ValueError, match="layout must be one of"):
        attempt(layout="rank_major")
    with pytest.raises(ValueError, match=r"y must be \[16, hidden\] \(the dispatch's expert_major"):
        combine("expert_major", "blocks")
    with pytest.raises(ValueError, match=r"y must be \[2, 8, hidden\]"):
        combine("blocks", "expert_major")
    combine("expert_major", "expert_major")
    combine("records", "expert_major")  # records: the combine takes the packed rows
    with pytest.raises(ValueError, match=r"y must be \[16, hidden\] \(the dispatch's expert_major"):
        combine("records", "records")

    with pytest.raises(ValueError, match="exceed max_tokens_per_rank=4"):
        attempt(T=5)
    with pytest.raises(ValueError, match="hidden divisible by 128"):
        attempt(H=100)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be >= 1"):
        attempt(M=0)
    with pytest.raises(TypeError, match="max_tokens_per_rank must be a Python or NumPy integer"):
        attempt(M=4.5)
    attempt(H=100, use_fp8=False)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_dispatch_refuses_an_fp8_pair(use_fp8):
    """The send quantises; a pair's scales would be dropped (and, with use_fp8, the e4m3 data
    quantised again), so a pair is an error, not wrong numbers."""
    R, T, H, E = 2, 4, 128, 4

    def fn(x, idx):
        pair = jax_ep.quantize_fp8(x)
        return jax_ep.low_latency_dispatch(pair, idx, num_experts=E, max_tokens_per_rank=T,
                                           axis_name=AXIS, use_fp8=use_fp8,
                                           backend="reference").x

    with pytest.raises(TypeError, match="takes unquantised rows"):
        run(fn, R, np.ones((R, T, H), np.float32), np.zeros((R, T, 2), np.int32))


def test_low_latency_combine_needs_weights():
    R, T, H, E = 2, 4, 128, 4

    def fn(x, idx):
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens_per_rank=T,
                                        axis_name=AXIS, use_fp8=False, backend="reference")
        return jax_ep.low_latency_combine(o.x, None, o.handle)

    with pytest.raises(TypeError, match="topk_weights is required"):
        run(fn, R, np.ones((R, T, H), np.float32), np.zeros((R, T, 2), np.int32))


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_drops_at_the_source(use_fp8):
    """A token listing an expert twice can give a source more than M pairs for one expert:
    the pairs whose per-(source, expert) slot is >= M are dropped and counted by the source."""
    R, T, M, H, K, E = 2, 4, 4, 128, 3, 4
    rng = np.random.default_rng(5)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = np.full((R, T, K), -1, np.int32)
    idx[0, :, :2] = 1  # rank 0: every token lists expert 1 twice -> 8 pairs, 4 kept
    idx[0, :, 2] = 3
    idx[1, :, 0] = 1
    idx[1, 1, 1] = E + 3  # out of range: ignored
    out = ll_dispatch(x, idx, E, M, use_fp8)
    want, slot = oracle.low_latency_dispatch(
        x, idx, E, M)
    np.testing.assert_array_equal(out.handle.send_slot, slot)
    np.testing.assert_array_equal(out.num_dropped, [4, 0])
    assert (slot[0, 2:, :2] == -1).all() and (slot[0, :2, :2] >= 0).all()
    for r in range(R):
        np.testing.assert_array_equal(out.recv_count[r], want[r]["recv_count"])
        np.testing.assert_array_equal(out.handle.recv_count[r], want[r]["recv_count"])
        for name in ("src_rank", "src_token", "src_k"):
            np.testing.assert_array_equal(getattr(out.handle, name)[r], want[r][name])


def test_ue8m0_scales_are_exact_powers_of_two():
    x = np.concatenate([np.ldexp(448.0, np.arange(-30, 30))[:, None] * np.ones((1, 128)),
                        np.random.default_rng(0).standard_normal((60, 128)) * 3], axis=0)
    _, s = jax_ep.quantize_fp8(jnp.asarray(x, jnp.float32), ue8m0=True)
    _, raw = jax_ep.quantize_fp8(jnp.asarray(x, jnp.float32))
    s, raw = np.asarray(s), np.asarray(raw)
    m, _ = np.frexp(s)
    assert (m == 0.5).all()
    assert (s >= raw).all() and (s < 2 * raw).all()
    np.testing.assert_array_equal(s[:60, 0], np.maximum(raw[:60, 0], 0))  # exact powers stay


def test_low_latency_buffer_hint_covers_both_parities():
    """The hint (the handlers' own formula) holds two dispatch regions in half of the buffer
    (per-expert counts, a pair header per (source, token, k), one record per (source, token) of
    the widest row) and two combine regions in the other half (every owner's gate words, an
    8-byte word per (owner, token, k), a tag and one partial row per (token, rank)). Needs the
    extension, not a GPU."""
    from jax_ep import _native

    if _native.load()[0] is None:
        pytest.skip("extension not built")
    for M, H, E, K, R in [(128, 7168, 256, 8, 2), (64, 256, 16, 8, 2), (5, 128, 8, 2, 8)]:
        got = jax_ep.low_latency_buffer_size_hint(M, H, E, K, R)
        row = H * 2  # a bf16 row (wider than FP8 data + scales)
        dispatch = 2 * (4 * E + 8 * R * M * K + R * M * row)
        combine = 2 * (8 * R * M * K + 4 * M * R + R * M * row)
        assert got >= dispatch * 2 and got >= combine * 2
        assert got <= 1.02 * max(dispatch * 2, combine * 2) + (1 << 20)
        assert jax_ep.low_latency_buffer_size_hint(M, H, E, K, R, jnp.float32) > got
        # a group across nodes: the combine also stages one partial row per (owner, token)
        across = jax_ep.low_latency_buffer_size_hint(M, H, E, K, R, across_nodes=True)
        assert across >= 2 * (combine + 2 * R * M * row) and across >= got


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_block_order_and_invalid_ids(split):
    """The block order the contract states, and ids outside [-1, E) counted per source."""
    R, T, M, H, K, E = 4, 6, 6, 128, 3, 8
    rng = np.random.default_rng(11)
    x, idx, _ = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    idx[1, 0, 0], idx[1, 3, 2], idx[3, 5, 1] = E, -2, E + 100
    out = ll_dispatch(x, idx, E, M, use_fp8=False, split=split)
    h = out.handle
    oracle.assert_low_latency_block_order(np.asarray(h.src_rank), np.asarray(h.src_token),
                                          np.asarray(h.src_k), np.asarray(out.recv_count))
    np.testing.assert_array_equal(out.num_invalid, [0, 2, 0, 1])


@pytest.mark.parametrize("layout", ["blocks", "expert_major", "records"])
def test_decode_example_interleaves_two_micro_batches(layout):
    """examples/decode_overlap.py on 4 fake CPU devices: the interleaved split calls give the
    tokens of the fused calls in turn (expert_major: through grouped GEMMs)."""
    import os
    import pathlib
    import subprocess
    import sys

    if tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 7):
        pytest.skip(f"jax {jax.__version__}: XLA:CPU computes some programs of split reference "
                    "calls tied by optimization barriers wrong (0.6.1: the interleaved "
                    "schedule's counts off; 0.7.0 and later right)")

    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "decode_overlap.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(example), "--devices", "4", "--layers", "2",
                          "--repeats", "1", "--backend", "reference", "--layout", layout],
                         capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the interleaved schedule's tokens match the one in turn" in out.stdout, out.stdout
