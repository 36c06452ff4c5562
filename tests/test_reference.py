"""The reference backend against the NumPy oracle: layout, dispatch, combine, on 1-8 ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep

import oracle
from ep import AXIS, run


def make_routing(rng, R, T, K, E, kind="random", mask_frac=0.0):
    """Global [R, T, K] expert ids: distinct per token (or all one expert), some masked (-1)."""
    if kind == "one_expert":
        idx = np.full((R, T, K), -1, np.int32)
        idx[..., 0] = E - 1  # everything goes to the last expert of the last rank
    else:
        idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                        for _ in range(R)]).astype(np.int32)
    if mask_frac:
        idx = np.where(rng.random(idx.shape) < mask_frac, -1, idx).astype(np.int32)
    return idx


def make_inputs(rng, R, T, H, K, E, kind="random", mask_frac=0.0, dtype=np.float32):
    x = rng.standard_normal((R, T, H)).astype(dtype)
    idx = make_routing(rng, R, T, K, E, kind, mask_frac)
    w = rng.random((R, T, K)).astype(np.float32) + 0.1
    return x, idx, w


def dispatch_all(x, idx, w, E, capacity=None, layout="rank_major", alignment=1,
                 backend="reference"):
    R = x.shape[0]

    def fn(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                               layout=layout, expert_alignment=alignment, backend=backend)

    return run(fn, R, x, idx, w)


def assert_matches_oracle(out, want, send_slot):
    R = len(want)
    for r in range(R):
        o = want[r]
        for name in ("x", "topk_idx", "topk_weights", "tokens_per_expert", "group_sizes",
                     "num_received", "num_dropped"):
            np.testing.assert_array_equal(np.asarray(getattr(out, name)[r]), o[name],
                                          err_msg=f"rank {r}: {name}")
        for name in ("src_rank", "src_token", "src_k"):
            np.testing.assert_array_equal(getattr(out.handle, name)[r], o[name],
                                          err_msg=f"rank {r}: handle.{name}")
    np.testing.assert_array_equal(out.handle.send_slot, send_slot, err_msg="handle.send_slot")


CASES = [
    # R, T, H, K, E, routing, mask
    (1, 9, 7, 2, 3, "random", 0.0),
    (2, 12, 13, 1, 6, "random", 0.0),
    (2, 10, 5, 4, 10, "random", 0.3),
    (4, 8, 7, 3, 12, "random", 0.0),
    (4, 11, 16, 8, 20, "random", 0.2),
    (4, 8, 9, 2, 12, "one_expert", 0.0),
    (8, 6, 3, 5, 24, "random", 0.25),
    (8, 7, 11, 8, 40, "random", 0.0),
    (4, 9, 6, 7, 28, "random", 0.1),  # top-7
    (8, 5, 4, 6, 8, "one_expert", 0.0),
]


@pytest.mark.parametrize("layout", ["rank_major", "expert_major", "source_slots"])
@pytest.mark.parametrize("R,T,H,K,E,kind,mask", CASES)
def test_dispatch_matches_oracle(R, T, H, K, E, kind, mask, layout):
    rng = np.random.default_rng(hash((R, T, H, K, E, kind, layout)) % 2**32)
    x, idx, w = make_inputs(rng, R, T, H, K, E, kind, mask)
    alignment = 4 if layout == "expert_major" and R >= 4 else 1
    out = dispatch_all(x, idx, w, E, layout=layout, alignment=alignment)
    C = jax_ep.default_capacity(T, R, K, E // R, layout, alignment)
    want, send_slot = oracle.dispatch(x, idx, w, E, C, layout, alignment)
    assert out.x.shape == (R, C, H)
    assert_matches_oracle(out, want, send_slot)
    assert out.num_dropped.sum() == 0


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("kind", ["random", "one_expert"])
def test_capacity_overflow_is_counted_and_deterministic(layout, kind):
    R, T, H, K, E = 4, 16, 6, 4, 8
    rng = np.random.default_rng(7)
    x, idx, w = make_inputs(rng, R, T, H, K, E, kind, 0.1)
    capacity = 9
    out = dispatch_all(x, idx, w, E, capacity=capacity, layout=layout)
    want, send_slot = oracle.dispatch(x, idx, w, E, capacity, layout)
    assert_matches_oracle(out, want, send_slot)
    assert out.num_dropped.sum() > 0
    # every addressed row is either received or counted as dropped
    dest, _ = oracle.route(idx, E, R)
    if layout == "rank_major":
        addressed = sum(((dest == r).any(-1)).sum() for r in range(R))
        received = (out.handle.src_rank >= 0).sum()
    else:
        addressed = (dest >= 0).sum()
        received = (out.handle.src_rank >= 0).sum()
    assert received + out.num_dropped.sum() == addressed
    again = dispatch_all(x, idx, w, E, capacity=capacity, layout=layout)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["rank_major", "source_slots"])
def test_every_token_rank_pair_arrives_exactly_once(layout):
    R, T, H, K, E = 8, 10, 5, 6, 16
    rng = np.random.default_rng(3)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    out = dispatch_all(x, idx, w, E, layout=layout)
    dest, local = oracle.route(idx, E, R)
    seen = set()
    for r in range(R):
        for row in range(out.x.shape[1]):
            s, t = out.handle.src_rank[r, row], out.handle.src_token[r, row]
            if s < 0:
                assert not out.x[r, row].any() and (out.topk_idx[r, row] == -1).all()
                continue
            assert layout == "rank_major" or row == s * T + t
            assert (s, t, r) not in seen
            seen.add((s, t, r))
            np.testing.assert_array_equal(out.x[r, row], x[s, t])
            mine = dest[s, t] == r
            np.testing.assert_array_equal(out.topk_idx[r, row], np.where(mine, local[s, t], -1))
            np.testing.assert_array_equal(out.topk_weights[r, row], np.where(mine, w[s, t], 0))
    wanted = {(s, t, r) for s in range(R) for t in range(T) for r in set(dest[s, t]) if r >= 0}
    assert seen == wanted


@pytest.mark.parametrize("R,E", [(1, 5), (2, 6), (4, 12), (8, 24)])
def test_layout_matches_oracle(R, E):
    T, K = 13, 4
    rng = np.random.default_rng(R)
    idx = make_routing(rng, R, T, K, E, mask_frac=0.3)

    def fn(idx):
        return jax_ep.get_dispatch_layout(idx, E, axis_name=AXIS, backend="reference")

    got = run(fn, R, idx)
    for r, (per_rank, per_expert, in_rank) in enumerate(oracle.layout(idx, E, R)):
        np.testing.assert_array_equal(got.num_tokens_per_rank[r], per_rank)
        np.testing.assert_array_equal(got.num_tokens_per_expert[r], per_expert)
        np.testing.assert_array_equal(got.is_token_in_rank[r], in_rank)


COMBINE_CASES = [(2, 9, 7, 3, 6, None), (4, 12, 13, 5, 12, None), (8, 6, 4, 8, 16, None),
                 (4, 12, 5, 4, 8, 11)]


@pytest.mark.parametrize("layout,R,T,H,K,E,capacity", [
    (layout,) + case for layout in ["rank_major", "expert_major", "source_slots"]
    for case in COMBINE_CASES if layout != "source_slots" or case[-1] is None])
def test_combine_matches_oracle(R, T, H, K, E, capacity, layout):
    rng = np.random.default_rng(R * 100 + H)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.15)
    out = dispatch_all(x, idx, w, E, capacity=capacity, layout=layout)
    C = out.x.shape[1]
    y = rng.standard_normal((R, C, H)).astype(np.float32)
    row_w = rng.random((R, C)).astype(np.float32)

    def fn(x, idx, w, y, row_w):
        o = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                            layout=layout, backend="reference")
        return jax_ep.combine(y, o.handle), jax_ep.combine(y, o.handle, weights=row_w)

    plain, weighted = run(fn, R, x, idx, w, y, row_w)
    slot = out.handle.send_slot
    np.testing.assert_array_equal(plain, oracle.combine(y, None, None, slot, idx, E, layout))
    np.testing.assert_array_equal(weighted, oracle.combine(y, row_w, None, slot, idx, E, layout))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_combine_of_dispatch_with_identity_experts(dtype):
    """Identity experts: combine(dispatch(x)) = x * (#ranks reached) (rank_major, source_slots),
    and = x * sum(w) weighted (expert_major)."""
    R, T, H, K, E = 4, 16, 33, 4, 12
    rng = np.random.default_rng(11)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    x = np.asarray(jnp.asarray(x, dtype))

    def fn(x, idx, w):
        rm = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend="reference")
        em = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout="expert_major",
                             expert_alignment=8, backend="reference")
        ss = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout="source_slots",
                             backend="reference")
        return (jax_ep.combine(rm.x, rm.handle),
                jax_ep.combine(em.x.astype(jnp.float32), em.handle, weights=em.topk_weights),
                jax_ep.combine(ss.x, ss.handle))

    by_rank, weighted, by_slot = run(fn, R, x, idx, w)
    np.testing.assert_array_equal(by_slot, by_rank)
    dest, _ = oracle.route(idx, E, R)
    reached = np.array([[len(set(d[d >= 0])) for d in dest[s]] for s in range(R)])
    xf = x.astype(np.float32)
    np.testing.assert_allclose(by_rank.astype(np.float32), xf * reached[..., None], rtol=1e-2)
    w_sum = np.where(idx >= 0, w, 0).sum(-1)
    np.testing.assert_allclose(weighted, xf * w_sum[..., None], rtol=1e-5, atol=1e-5)


def test_repeated_runs_are_identical():
    R, T, H, K, E = 8, 9, 10, 4, 16
    rng = np.random.default_rng(5)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.1)
    first = dispatch_all(x, idx, w, E, layout="expert_major", alignment=2, capacity=50)
    for _ in range(3):
        again = dispatch_all(x, idx, w, E, layout="expert_major", alignment=2, capacity=50)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["rank_major", "source_slots", "expert_major"])
def test_out_of_range_ids_under_tracing_are_ignored_and_counted(layout):
    """Traced ids cannot be checked at trace time: outside [-1, E) they act as -1 and every
    such (token, k) entry is counted in num_invalid on its source rank."""
    R, T, H, K, E = 2, 6, 4, 2, 4
    rng = np.random.default_rng(0)
    x, idx, w = make_inputs(rng, R, T, H, K, E)
    bad = idx.copy()
    bad[0, 0, 0], bad[1, 2, 1], bad[1, 4, 0] = E + 3, -7, E
    masked = np.where((bad < 0) | (bad >= E), -1, bad).astype(np.int32)
    got = dispatch_all(x, bad, w, E, layout=layout)
    want, slot = oracle.dispatch(x, masked, w, E, got.x.shape[1], layout)
    assert_matches_oracle(got, want, slot)
    np.testing.assert_array_equal(got.num_invalid, [1, 2])
    np.testing.assert_array_equal(dispatch_all(x, masked, w, E, layout=layout).num_invalid,
                                  [0, 0])


def test_narrow_and_unsigned_ids_are_counted_without_wrapping():
    R, T, H, K, E = 2, 4, 4, 2, 200
    x = np.ones((R, T, H), np.float32)
    for dtype, bad in ((np.int8, -100), (np.uint8, 250), (np.uint32, 2 ** 32 - 1)):
        idx = np.zeros((R, T, K), dtype)
        idx[0, 1, 1] = bad
        got = dispatch_all(x, idx, np.ones((R, T, K), np.float32), E)
        np.testing.assert_array_equal(got.num_invalid, [1, 0], err_msg=str(dtype))
        np.testing.assert_array_equal(got.tokens_per_expert.sum(), R * T * K - 1)


@pytest.mark.parametrize("R,cap", [(2, None), (4, None), (4, 0.6), (8, 0.4)])
def test_rank_major_blocks_are_what_the_copy_engine_combine_indexes(R, cap):
    """The copy-engine combine (ffi/kernels/intranode_combine.cu) relies on the rank_major
    contract: at every rank, the rows of one source form a contiguous block in source order,
    starting at the first row whose src_rank >= s, in the source's token order; so the
    source finds its token's record at slot - (its smallest slot at that rank)."""
    T, H, K, E = 40, 4, 3, 3 * R
    rng = np.random.default_rng(R)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.2)
    capacity = None if cap is None else int(cap * T * R)

    def fn(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity,
                              backend="reference")
        h = out.handle
        return h.src_rank, h.src_token, h.send_slot, h.num_received

    src_rank, src_token, send_slot, used = run(fn, R, x, idx, w)
    for r in range(R):
        n = int(used[r])
        ranks = src_rank[r][:n]
        assert (np.diff(ranks) >= 0).all() and (src_rank[r][n:] == -1).all()
        for s in range(R):
            start = int(np.searchsorted(ranks, s, side="left"))
            block = src_token[r][start:start + int((ranks == s).sum())]
            assert (np.diff(block) > 0).all()  # the source's tokens, ascending
            slots = send_slot[s][:, r]
            kept = slots[slots >= 0]
            if kept.size:
                assert kept.min() == start
                q = slots - kept.min()
                for t in np.nonzero(slots >= 0)[0]:
                    assert block[q[t]] == t


def test_source_slots_are_the_rank_major_rows_at_fixed_slots():
    """Row s*T + t at rank r is rank_major's row of (s, t) there when t has an expert on r;
    every other row is unused (zero, -1 ids and handle entries); send_slot is known at the
    source; combine sums the same rows in the same order as rank_major's (bit-identical)."""
    R, T, H, K, E = 4, 6, 5, 3, 8
    rng = np.random.default_rng(17)
    x, idx, w = make_inputs(rng, R, T, H, K, E, "random", 0.3)
    idx = np.where(idx // (E // R) == 0, -1, idx).astype(np.int32)  # rank 0 gets no token
    idx[R - 1, T - 1] = -1  # the last slot is unused everywhere
    C = R * T

    def fn(x, idx, w):
        rm = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend="reference")
        ss = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=C,
                             layout="source_slots", backend="reference")
        return rm, ss, jax_ep.combine(rm.x, rm.handle), jax_ep.combine(ss.x, ss.handle)

    rm, ss, rm_back, ss_back = run(fn, R, x, idx, w)
    assert ss.x.shape == (R, C, H)
    for r in range(R):
        used = ss.handle.src_rank[r] >= 0
        n = int(rm.num_received[r])
        assert used.sum() == n
        for name in ("x", "topk_idx", "topk_weights"):
            np.testing.assert_array_equal(getattr(ss, name)[r][used], getattr(rm, name)[r][:n],
                                          err_msg=f"rank {r}: {name}")
        for name in ("src_rank", "src_token", "src_k"):
            np.testing.assert_array_equal(getattr(ss.handle, name)[r][used],
                                          getattr(rm.handle, name)[r][:n], err_msg=name)
        rows = np.nonzero(used)[0]
        np.testing.assert_array_equal(
            rows, ss.handle.src_rank[r][used] * T + ss.handle.src_token[r][used])
        assert not ss.x[r][~used].any() and not ss.topk_weights[r][~used].any()
        assert (ss.topk_idx[r][~used] == -1).all()
        for name in ("src_token", "src_k"):
            assert (getattr(ss.handle, name)[r][~used] == -1).all()
        assert ss.num_received[r] == ss.handle.num_received[r] == (rows.max() + 1 if n else 0)
        np.testing.assert_array_equal(ss.tokens_per_expert[r], rm.tokens_per_expert[r])
        np.testing.assert_array_equal(ss.group_sizes[r], rm.tokens_per_expert[r])
    assert ss.num_received[0] == 0 and (ss.num_received < C).all() and ss.num_received.max() > 0
    assert not ss.num_dropped.any()
    dest, _ = oracle.route(idx, E, R)
    for s in range(R):
        reaches = (dest[s][:, :, None] == np.arange(R)).any(1)  # [T, R]
        want = np.where(reaches, s * T + np.arange(T)[:, None], -1)
        np.testing.assert_array_equal(ss.handle.send_slot[s], want, err_msg=f"source {s}")
    np.testing.assert_array_equal(ss_back, rm_back)


def test_source_slots_capacity_is_fixed_and_alignment_is_rejected():
    R, T, H, K, E = 2, 4, 3, 2, 4
    x, idx, w = make_inputs(np.random.default_rng(0), R, T, H, K, E)
    for capacity in (7, 9, 0):
        with pytest.raises(ValueError, match=(
                r"layout='source_slots' has exactly num_ranks \* num_tokens = 8 rows; "
                rf"capacity must be 8 \(or None\), got {capacity}")):
            dispatch_all(x, idx, w, E, capacity=capacity, layout="source_slots")
    with pytest.raises(ValueError, match="applies to layout='expert_major' only"):
        dispatch_all(x, idx, w, E, layout="source_slots", alignment=4)
    assert dispatch_all(x, idx, w, E, capacity=R * T, layout="source_slots").x.shape == (R, 8, H)
