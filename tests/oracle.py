"""Loop-based NumPy oracle of the dispatch/combine contract, written independently of the backends.

Everything is computed for all ranks at once from global arrays shaped [R, T, ...].
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def quantize_fp8(x, ue8m0=False):
    """jax_ep.quantize_fp8's arithmetic in NumPy float32, each step correctly rounded (the
    stated contract): [..., H] -> (e4m3 data, float32 scales [..., H // 128])."""
    b = np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], -1, 128)
    scale = np.maximum(np.abs(b).max(-1), np.float32(1e-10)) * np.float32(1.0 / 448.0)
    if ue8m0:
        mantissa, exponent = np.frexp(scale)
        exponent = np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.int32)
        scale = ((exponent + 127) << 23).astype(np.int32).view(np.float32)
    q = np.clip(b * (np.float32(1.0) / scale)[..., None], np.float32(-448.0), np.float32(448.0))
    return q.astype(ml_dtypes.float8_e4m3fn).reshape(np.shape(x)), scale.astype(np.float32)


def route(topk_idx, num_experts, num_ranks):
    """Destination rank and local id per (rank, token, k); -1 where masked or out of range."""
    L = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return np.where(valid, topk_idx // L, -1), np.where(valid, topk_idx % L, -1)


def layout(topk_idx, num_experts, num_ranks):
    """Per rank: tokens per rank [R], pairs per expert [E], is_token_in_rank [T, R]."""
    dest, _ = route(topk_idx, num_experts, num_ranks)
    out = []
    for r in range(topk_idx.shape[0]):
        in_rank = np.zeros((topk_idx.shape[1], num_ranks), bool)
        per_expert = np.zeros(num_experts, np.int32)
        for t in range(topk_idx.shape[1]):
            for k in range(topk_idx.shape[2]):
                if dest[r, t, k] >= 0:
                    in_rank[t, dest[r, t, k]] = True
                    per_expert[topk_idx[r, t, k]] += 1
        out.append((in_rank.sum(0).astype(np.int32), per_expert, in_rank))
    return out


def dispatch(x, topk_idx, topk_weights, num_experts, capacity, layout="rank_major",
             alignment=1, x_scales=None):
    """Returns one dict per destination rank with every output and handle array.

    source_slots needs capacity R*T: its rows are rank_major's, each at row s*T + t."""
    R, T, K = topk_idx.shape
    L = num_experts // R
    C = capacity
    dest, local = route(topk_idx, num_experts, R)
    H = x.shape[-1]
    results = []
    send_slot = (np.full((R, T, K), -1, np.int32) if layout == "expert_major"
                 else np.full((R, T, R), -1, np.int32))
    for me in range(R):
        o = dict(
            x=np.zeros((C, H), x.dtype),
            x_scales=None if x_scales is None else np.zeros((C, x_scales.shape[-1]), np.float32),
            src_rank=np.full(C, -1, np.int32), src_token=np.full(C, -1, np.int32),
            src_k=np.full(C, -1, np.int32), num_dropped=0)
        if layout in ("rank_major", "source_slots"):
            slots = layout == "source_slots"
            if slots:
                assert C == R * T, "source_slots has exactly R*T rows"
            o["topk_idx"] = np.full((C, K), -1, np.int32)
            o["topk_weights"] = np.zeros((C, K), np.float32)
            packed, end = 0, 0  # rows placed so far (rank_major), largest used row + 1
            for s in range(R):
                for t in range(T):
                    mine = dest[s, t] == me
                    if not mine.any():
                        continue
                    row = s * T + t if slots else packed
                    if row >= C:
                        o["num_dropped"] += 1
                        continue
                    o["x"][row] = x[s, t]
                    if x_scales is not None:
                        o["x_scales"][row] = x_scales[s, t]
                    o["topk_idx"][row] = np.where(mine, local[s, t], -1)
                    o["topk_weights"][row] = np.where(mine, topk_weights[s, t], 0)
                    o["src_rank"][row], o["src_token"][row] = s, t
                    send_slot[s, t, me] = row
                    packed += 1
                    end = row + 1
            o["num_received"] = end
            o["tokens_per_expert"] = np.array(
                [(o["topk_idx"] == e).sum() for e in range(L)], np.int32)
            o["group_sizes"] = o["tokens_per_expert"]
        elif layout == "expert_major":
            o["topk_idx"] = np.full(C, -1, np.int32)
            o["topk_weights"] = np.zeros(C, np.float32)
            pairs = [[] for _ in range(L)]
            for s in range(R):
                for t in range(T):
                    for k in range(K):
                        if dest[s, t, k] == me:
                            pairs[local[s, t, k]].append((s, t, k))
            start = 0
            group_sizes = np.zeros(L, np.int32)
            kept_per_expert = np.zeros(L, np.int32)
            for e in range(L):
                n = len(pairs[e])
                aligned = -(-n // alignment) * alignment
                group_sizes[e] = max(0, min(start + aligned, C) - min(start, C))
                for i, (s, t, k) in enumerate(pairs[e]):
                    row = start + i
                    if row >= C:
                        o["num_dropped"] += 1
                        continue
                    o["x"][row] = x[s, t]
                    if x_scales is not None:
                        o["x_scales"][row] = x_scales[s, t]
                    o["topk_idx"][row] = e
                    o["topk_weights"][row] = topk_weights[s, t, k]
                    o["src_rank"][row], o["src_token"][row], o["src_k"][row] = s, t, k
                    send_slot[s, t, k] = row
                    kept_per_expert[e] += 1
                start += aligned
            o["group_sizes"] = group_sizes
            o["tokens_per_expert"] = kept_per_expert
            o["num_received"] = int(group_sizes.sum())
        else:
            raise ValueError(f"unknown layout {layout!r}")
        results.append(o)
    return results, send_slot


def combine(y, weights, per_rank, send_slot, topk_idx, num_experts, layout="rank_major"):
    """y: [R, C, H] rows per expert rank; returns [R, T, H] float32 sums in the contract order:
    by rank for rank_major and source_slots; expert_major: each rank's rows of a token summed
    by k and cast to y's dtype, then those partials by rank."""
    R, T, K = topk_idx.shape
    dest, _ = route(topk_idx, num_experts, R)
    out = np.zeros((R, T, y.shape[-1]), np.float32)

    def term(r, row):
        w = np.float32(1) if weights is None else np.float32(weights[r, row])
        return w * y[r, row].astype(np.float32)

    for s in range(R):
        for t in range(T):
            acc = np.zeros(y.shape[-1], np.float32)
            for r in range(R):
                if layout != "expert_major":
                    row = send_slot[s, t, r]
                    if row >= 0:
                        acc = acc + term(r, row)
                    continue
                rows = [send_slot[s, t, k] for k in range(K)
                        if dest[s, t, k] == r and send_slot[s, t, k] >= 0]
                if rows:
                    partial = np.zeros(y.shape[-1], np.float32)
                    for row in rows:
                        partial = partial + term(r, row)
                    acc = acc + partial.astype(y.dtype).astype(np.float32)
            out[s, t] = acc
    return out


def low_latency_dispatch(x, topk_idx, num_experts, max_tokens):
    """Per destination rank: x blocks [L, R*M, ...], recv_count [L], src arrays; per source
    rank num_dropped; plus send_slot (the per-(source, expert) slot, -1 = not sent)."""
    R, T, K = topk_idx.shape
    L = num_experts // R
    rows = R * max_tokens
    dest, local = route(topk_idx, num_experts, R)
    send_slot = np.full((R, T, K), -1, np.int32)
    dropped = np.zeros(R, np.int32)
    for s in range(R):
        seen = np.zeros(num_experts, np.int64)
        for t in range(T):
            for k in range(K):
                if dest[s, t, k] < 0:
                    continue
                e = topk_idx[s, t, k]
                if seen[e] < max_tokens:
                    send_slot[s, t, k] = seen[e]
                else:
                    dropped[s] += 1
                seen[e] += 1
    results = []
    for me in range(R):
        o = dict(x=np.zeros((L, rows) + x.shape[2:], x.dtype),
                 src_rank=np.full((L, rows), -1, np.int32),
                 src_token=np.full((L, rows), -1, np.int32),
                 src_k=np.full((L, rows), -1, np.int32),
                 recv_count=np.zeros(L, np.int32), num_dropped=dropped[me])
        for s in [(me + q) % R for q in range(R)]:  # this rank's own pairs first
            for t in range(T):
                for k in range(K):
                    if dest[s, t, k] != me or send_slot[s, t, k] < 0:
                        continue
                    e = local[s, t, k]
                    row = o["recv_count"][e]
                    o["x"][e, row] = x[s, t]
                    o["src_rank"][e, row], o["src_token"][e, row], o["src_k"][e, row] = s, t, k
                    o["recv_count"][e] += 1
        # the row each source pair became here
        o["pair_row"] = np.full((R, T, K), -1, np.int32)
        for e in range(L):
            for i in range(o["recv_count"][e]):
                s, t, k = o["src_rank"][e, i], o["src_token"][e, i], o["src_k"][e, i]
                o["pair_row"][s, t, k] = e * rows + i
        results.append(o)
    return results, send_slot


def low_latency_packed(o, num_topk):
    """One rank's low_latency_dispatch result in the expert_major layout: each block's used
    rows packed one after another into R*M*min(K, L) rows (the rest zero / -1), pair_row
    renumbered to match."""
    L, rows = o["src_rank"].shape
    P = rows * min(num_topk, L)
    start = np.concatenate([[0], np.cumsum(o["recv_count"])[:-1]]).astype(np.int64)
    packed = {}
    for name, fill in (("x", 0), ("src_rank", -1), ("src_token", -1), ("src_k", -1)):
        v = o[name]
        out = np.full((P,) + v.shape[2:], fill, v.dtype)
        for e in range(L):
            n = o["recv_count"][e]
            out[start[e]:start[e] + n] = v[e, :n]
        packed[name] = out
    pr = o["pair_row"]
    packed["pair_row"] = np.where(pr >= 0, start[np.maximum(pr, 0) // rows] + pr % rows,
                                  -1).astype(np.int32)
    packed["recv_count"], packed["num_dropped"] = o["recv_count"], o["num_dropped"]
    return packed


def low_latency_records(packed, payload, max_tokens):
    """One rank's x in the records layout from its packed result: row s*M + t is source s's
    token t (payload [R, T, ...]) if a packed row came from it, else zero."""
    R, T = payload.shape[:2]
    out = np.zeros((R * max_tokens,) + payload.shape[2:], payload.dtype)
    for s, t in zip(packed["src_rank"], packed["src_token"]):
        if s >= 0:
            out[s * max_tokens + t] = payload[s, t]
    return out


def low_latency_unpacked(y, recv_count, rows):
    """Packed rows y [P, ...] of one rank -> blocks [L, rows, ...] (unused rows zero)."""
    L = len(recv_count)
    start = np.concatenate([[0], np.cumsum(recv_count)[:-1]])
    out = np.zeros((L, rows) + y.shape[1:], y.dtype)
    for e in range(L):
        out[e, :recv_count[e]] = y[start[e]:start[e] + recv_count[e]]
    return out


def low_latency_combine(y, topk_weights, topk_idx, num_experts, max_tokens):
    """y: [R, L, R*M, H]; for source s, token t: each expert rank r sums w * (the row pair
    (t, k) became there) over its pairs in k ascending order, in float32, rounded to y's
    dtype; out[s, t] = the sum of those partials over r ascending, in float32, rounded to y's
    dtype. Pairs not sent add nothing."""
    R, T, K = topk_idx.shape
    results, _ = low_latency_dispatch(np.zeros((R, T, 1), np.float32), topk_idx, num_experts,
                                      max_tokens)
    row_of = {}
    for me, o in enumerate(results):
        for le, row in zip(*np.nonzero(o["src_rank"] >= 0)):
            key = (o["src_rank"][le, row], o["src_token"][le, row], o["src_k"][le, row])
            row_of[key] = (me, le, row)
    out = np.zeros((R, T, y.shape[-1]), y.dtype)
    for s in range(R):
        for t in range(T):
            total = np.zeros(y.shape[-1], np.float32)
            for r in range(R):
                partial, any_here = np.zeros(y.shape[-1], np.float32), False
                for k in range(K):
                    where = row_of.get((s, t, k))
                    if where is None or where[0] != r:
                        continue
                    partial = partial + np.float32(topk_weights[s, t, k]) * y[where].astype(
                        np.float32)
                    any_here = True
                if any_here:
                    total = total + partial.astype(y.dtype).astype(np.float32)
            out[s, t] = total.astype(y.dtype)
    return out


def assert_low_latency_block_order(src_rank, src_token, src_k, recv_count):
    """The contract's low-latency block order (jax_ep/_types.py), checked on gathered handles
    [R, L, R*M]: on rank me, each block's used rows are a prefix of recv_count[l] rows sorted
    by (source position in me, me + 1, ..., me - 1; source token; k), strictly."""
    R, L, _ = src_rank.shape
    for me in range(R):
        for e in range(L):
            n = int(recv_count[me, e])
            assert (src_rank[me, e, :n] >= 0).all() and (src_rank[me, e, n:] == -1).all()
            keys = [((int(s) - me) % R, int(t), int(k)) for s, t, k in
                    zip(src_rank[me, e, :n], src_token[me, e, :n], src_k[me, e, :n])]
            assert all(a < b for a, b in zip(keys, keys[1:])), (me, e, keys)
