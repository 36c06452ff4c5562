"""Data types shared by the public API and every backend.

The layout contract (both backends produce exactly this; the reference backend is its
executable specification). Per device, inside ``shard_map`` over the EP axis of size R,
with T local tokens, top-k K, E experts, L = E // R local experts, C = capacity:

* ``rank_major`` (DeepEP's layout): one row per (token, destination rank) pair, a token
  is sent once to each rank that holds any of its experts. Rows are ordered by
  (source rank, source token index). Rows at positions >= C are dropped and counted.
* ``expert_major`` (ready for ``jax.lax.ragged_dot``): one row per (token, k) pair whose
  expert lives here. Rows are grouped by local expert; each group starts at
  ``start[e] = sum_{e' < e} round_up(n[e'], alignment)`` (n = pairs for e, all sources),
  and inside a group rows are ordered by (source rank, source token, k). Pairs whose
  position is >= C are dropped and counted.
* ``source_slots`` (rank_major rows, not packed): exactly C = R*T rows; row ``s*T + t``
  belongs to source rank s's token t, so each source's rows are one contiguous block that
  a copy engine can move whole. The row is used when the token has an expert here and then
  holds what the token's rank_major row holds; otherwise it is unused. Nothing is dropped;
  num_received is the largest used row index + 1. With few ranks a peer needs nearly every
  token (top-8 of 256: 99.6 % on 2 ranks, 90 % on 4), so few rows stay unused; not for
  many ranks (a third of the rows would be unused on 8).

Unused rows (padding, past the received count, source_slots' rows of tokens with no expert
here) have zero data, topk_idx -1, weight 0, and -1 in every handle array.

Combine (sums in float32, fixed order; w_row is the optional per-row weight, 1 when not
given; dropped rows add zero):
* rank_major, source_slots: out[t] = sum over ranks r ascending of w_row * y_row(t, r), cast
  to y's dtype.
* expert_major: each rank r first sums its rows of token t over k ascending,
  p_r(t) = sum_k w_row * y_row(t, k), and casts p_r(t) to y's dtype; then
  out[t] = sum over ranks r ascending of p_r(t), cast to y's dtype. So one row per
  (token, rank) crosses back, as the dispatch sends one per (token, rank) (the expansion to
  (token, k) rows happens on the receiving rank).
* Across nodes (the EP axis spans nodes of G ranks each, ``DispatchConfig.node_size``): the
  terms above of the ranks of each node n are first added in rank order (float32) and cast to
  y's dtype, q_n(t); out[t] = sum over nodes n ascending of q_n(t), cast to y's dtype. So one
  row per (token, node) crosses the network back, as the dispatch sends one per (token, node).
  With one node this is the order above.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

RANK_MAJOR = "rank_major"
EXPERT_MAJOR = "expert_major"
SOURCE_SLOTS = "source_slots"
LAYOUTS = (RANK_MAJOR, EXPERT_MAJOR, SOURCE_SLOTS)
LL_BLOCKS = "blocks"  # low latency: [L, R*M] rows, block l's first recv_count[l] used
LL_RECORDS = "records"  # low latency: one row per (source, token), the pairs by index
LL_LAYOUTS = (LL_BLOCKS, EXPERT_MAJOR, LL_RECORDS)


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Static description of one dispatch; hashable, travels as static pytree metadata."""

    num_experts: int
    num_ranks: int
    num_tokens: int  # local tokens per rank (the same on every rank: shard_map shapes)
    hidden: int
    num_topk: int
    capacity: int
    layout: str = RANK_MAJOR
    alignment: int = 1
    axis_name: Any = None
    backend: str = "reference"
    tuning: Any = None  # jax_ep.Config given to dispatch (None: overrides and defaults)
    # Ranks of the EP axis per node where the axis spans nodes (the runtime's topology), else
    # None: the combine then adds per-node partials (see the contract above), and the CUDA
    # backend dispatches hierarchically (node exchange, then NVLink inside the node).
    node_size: int | None = None
    # The node-local stage of such a dispatch (CUDA backend): its ranks are the node_size
    # ranks of this device's node on the axis, its tokens the node exchange's blocks.
    within_node: bool = False
    # x arrives unquantised and is quantised on the way (dispatch's use_fp8): the rows come
    # out e4m3 with their scales, as from dispatch(quantize_fp8(x, ue8m0=ue8m0), ...).
    use_fp8: bool = False
    ue8m0: bool = False

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


def default_capacity(num_tokens, num_ranks, num_topk, num_local_experts, layout=RANK_MAJOR,
                     alignment=1) -> int:
    """The worst case: nothing is ever dropped (source_slots: its only row count, R * T)."""
    if layout == EXPERT_MAJOR:
        return num_ranks * num_tokens * num_topk + num_local_experts * (alignment - 1)
    return num_ranks * num_tokens  # rank_major: a token reaches a rank at most once


def no_pair_rows() -> jax.Array:
    """``DispatchHandle.pair_row`` of the layouts that have none."""
    return jnp.full((1,), -1, jnp.int32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """Routing state of one dispatch, reused by combine and by both backward passes.

    Arrays (per device):
      topk_idx:   [T, K] int32  the source's global expert ids (-1 = none).
      send_slot:  rank_major, source_slots [T, R] / expert_major [T, K] int32: row index at
                  the destination where this (token, rank) / (token, k) pair landed;
                  -1 when nothing was sent or the row was dropped (source_slots: me*T + t,
                  me = this rank, wherever token t has an expert on rank r; no exchange).
                  Across nodes the CUDA backend leaves it -1: a row's place is decided on
                  its destination's node (node_stage holds what the combine needs).
      src_rank:   [C] int32  source rank of each received row (-1 = unused row).
      src_token:  [C] int32  source token index of each received row (-1 = unused).
      src_k:      [C] int32  expert_major: top-k slot of each row; otherwise all -1.
      num_received: [] int32 DispatchOutput.num_received: no row at or past it is used.
      pair_row:   expert_major [R, T, K] int32: the row here that pair (source s, token t, k)
                  became, -1 if none (the inverse of src_rank/src_token/src_k: the combine
                  sums a token's rows here, and its backward stores a token's row to each,
                  without a search); other layouts [1] holding -1 (``no_pair_rows``: not
                  empty, since XLA's compiler crashed on an empty program parameter).
    """

    topk_idx: jax.Array
    send_slot: jax.Array
    src_rank: jax.Array
    src_token: jax.Array
    src_k: jax.Array
    num_received: jax.Array
    pair_row: jax.Array
    config: DispatchConfig
    # Across nodes (CUDA backend): the node-local stage's handle, and row_map [C] int32, the
    # row of that stage's output each row here came from (-1: unused).
    node_stage: Any = None
    row_map: Any = None

    def tree_flatten(self):
        children = (self.topk_idx, self.send_slot, self.src_rank, self.src_token,
                    self.src_k, self.num_received, self.pair_row, self.node_stage, self.row_map)
        return children, self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        *arrays, node_stage, row_map = children
        return cls(*arrays, config=config, node_stage=node_stage, row_map=row_map)


class DispatchOutput(NamedTuple):
    """What ``dispatch`` returns on every device.

    x:            [C, H] received rows (bf16/f32), or FP8 e4m3 data when dispatching FP8.
    x_scales:     [C, H // 128] float32 block scales for FP8, else None.
    topk_idx:     rank_major, source_slots [C, K] local expert ids (-1 = expert not here /
                  unused row); expert_major [C] local expert id of each row (-1 = padding /
                  unused).
    topk_weights: same shape as topk_idx, float32 (0 where the id is -1).
    tokens_per_expert: [L] int32 received (kept) pairs per local expert.
    group_sizes:  [L] int32 rows per local expert group as laid out (expert_major:
                  aligned and clipped to capacity, sums to <= C; rank_major, source_slots:
                  equal to tokens_per_expert).
    num_received: [] int32 the end of the rows in use (no row at or past it is used).
                  rank_major: the rows received (packed: also the largest used row index
                  + 1); expert_major: the end of the last group, alignment padding included
                  (the sum of group_sizes); source_slots: the largest used row index + 1, 0
                  when no row is used (unused rows may lie below it).
    num_dropped:  [] int32 rows addressed to this rank that did not fit in the capacity
                  (always 0 for source_slots).
    handle:       DispatchHandle for combine and the backward passes.
    num_invalid:  [] int32 (token, k) entries of this rank's topk_idx outside [-1, E): they
                  are treated as -1 (sent nowhere, never read), and counted here.
    """

    x: jax.Array
    x_scales: jax.Array | None
    topk_idx: jax.Array
    topk_weights: jax.Array
    tokens_per_expert: jax.Array
    group_sizes: jax.Array
    num_received: jax.Array
    num_dropped: jax.Array
    handle: DispatchHandle
    num_invalid: jax.Array | None = None  # set by jax_ep.dispatch (backends leave it None)


class DispatchLayout(NamedTuple):
    """``get_dispatch_layout`` result (DeepEP's semantics; -1 ids are ignored)."""

    num_tokens_per_rank: jax.Array  # [R] int32 tokens with at least one expert on rank r
    num_tokens_per_expert: jax.Array  # [E] int32 (token, k) pairs per global expert
    is_token_in_rank: jax.Array  # [T, R] bool


# ----------------------------------------------------------------------------- low latency
#
# Decode-time contract: every rank sends at most M = max_tokens_per_rank tokens; each
# (token, k) pair is one row in the receive block of its expert. A pair's slot is its rank
# among its source's pairs for the same expert, in (token, k) order (computed at the source,
# no exchange); a pair whose slot is >= M is dropped at the source and counted in the
# source's num_dropped (only possible when a token lists one expert twice). Local expert
# l's block is [R * M] rows; its first recv_count[l] rows are used (layout "blocks", x
# [L, R*M, H]); with layout EXPERT_MAJOR the blocks' used rows are packed one after another
# into x [R*M*min(K, L), H], group l at rows [sum(recv_count[:l]), sum(recv_count[:l + 1]))
# (the rows grouped_matmul takes; every pair a rank can receive fits). On rank ``me`` they are
# ordered by source rank in the order me, me + 1, ..., R - 1, 0, ..., me - 1 (this rank's own
# pairs first: the fused CUDA dispatch writes them while the peers' records are in flight),
# then by (source token, k): row = (kept pairs for l of the sources before s in that order)
# + slot (within the group). The rest have -1 handle entries and unspecified data (the
# reference backend zeroes it; the CUDA kernels leave it, as a decode step must not write
# L*R*M rows). With layout LL_RECORDS x holds each token once: x [R*M, H], row s*M + t the
# token t of source s if any of its pairs was kept here (else unspecified, the reference
# zeroes it), and the handle describes expert_major's packed rows, which x's rows
# handle.record_rows() make up (a row per kept pair, read by index: no row is copied once
# per pair). Combine takes y in the dispatch's layout (records: expert_major's) and weights
# each row by the source's gate; each expert rank sums its rows of a token in k order in
# float32 and rounds that partial to y's dtype; the token's owner adds the partials in rank
# order (0, 1, ..., R - 1) in float32 and rounds to y's dtype.


@dataclasses.dataclass(frozen=True)
class LowLatencyConfig:
    num_experts: int
    num_ranks: int
    num_tokens: int
    hidden: int
    num_topk: int
    max_tokens_per_rank: int
    use_fp8: bool = True
    ue8m0: bool = False
    axis_name: Any = None
    backend: str = "reference"
    tuning: Any = None  # jax_ep.Config (num_blocks only)
    layout: str = LL_BLOCKS  # or EXPERT_MAJOR, LL_RECORDS

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows_per_expert(self) -> int:
        return self.num_ranks * self.max_tokens_per_rank

    @property
    def packed(self) -> bool:
        """The pairs' rows are packed by local expert (expert_major, and records' index)."""
        return self.layout in (EXPERT_MAJOR, LL_RECORDS)

    @property
    def rows_shape(self) -> tuple:
        """Leading dims of y and the handle's src_* in this layout (and of x but for
        records): (L, R*M) blocks, or (R*M*min(K, L),) packed rows."""
        if self.packed:
            return (self.rows_per_expert * min(self.num_topk, self.num_local_experts),)
        return (self.num_local_experts, self.rows_per_expert)

    @property
    def x_rows_shape(self) -> tuple:
        """Leading dims of the dispatch's x: rows_shape, or records' (R*M,)."""
        return (self.rows_per_expert,) if self.layout == LL_RECORDS else self.rows_shape


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
    """Routing state of one low-latency dispatch.

      topk_idx:  [T, K] int32 the source's global expert ids (-1 = none).
      send_slot: [T, K] int32 per-(source, expert) slot of the pair: its rank among this
                 source's pairs for the same expert, in (token, k) order; -1 = not sent
                 (no valid expert) or dropped (slot >= M).
      src_rank:  [L, R*M] (expert_major and records: [P]) int32 source rank of each received
                 row (-1 = unused).
      src_token: like src_rank: source token of each received row (-1 = unused).
      src_k:     like src_rank: top-k slot of each received row (-1 = unused).
      recv_count: [L] int32 used rows per local expert (the used rows are a prefix of each
                 block, or of the packed rows).
      pair_row:  [R, T, K] int32 the row (of the flattened received rows) that pair (source
                 s, token t, k) became here, -1 if none: the combine's lookup, local at every
                 expert rank (it needs no owner's routing).
    """

    topk_idx: jax.Array
    send_slot: jax.Array
    src_rank: jax.Array
    src_token: jax.Array
    src_k: jax.Array
    recv_count: jax.Array
    pair_row: jax.Array
    config: LowLatencyConfig

    def record_rows(self) -> jax.Array:
        """[P] int32, packed layouts: the record (row of a records dispatch's x, s*M + t) that
        each packed row reads, -1 for unused rows; ``experts.grouped_matmul(x, w,
        recv_count, row_index=handle.record_rows())`` multiplies a records dispatch's rows
        as if packed, and ``x[rows]`` (rows clipped, masked) gathers them."""
        if not self.config.packed:
            raise ValueError("record_rows: the handle of an expert_major or records dispatch")
        M = self.config.max_tokens_per_rank
        used = self.src_rank >= 0
        return jnp.where(used, self.src_rank * M + self.src_token, -1).astype(jnp.int32)

    def tree_flatten(self):
        return (self.topk_idx, self.send_slot, self.src_rank, self.src_token, self.src_k,
                self.recv_count, self.pair_row), self.config

    @classmethod
    def tree_unflatten(cls, config, children):
        return cls(*children, config=config)


class LowLatencyOutput(NamedTuple):
    """x: [L, R*M, H], expert_major [P = R*M*min(K, L), H] or records [R*M, H] (e4m3 when
    FP8, else x's dtype); x_scales: [L, R*M, H//128] (expert_major [P, H//128], records
    [R*M, H//128]) f32 or None;
    recv_count: [L] int32 rows used per local expert; num_dropped: [] int32 pairs of this
    rank's tokens dropped at the source because their per-(source, expert) slot was >= M
    (only possible when a token lists one expert twice);
    handle: LowLatencyHandle; num_invalid: [] int32 (token, k) entries of this rank's
    topk_idx outside [-1, E), treated as -1 and counted."""

    x: jax.Array
    x_scales: jax.Array | None
    recv_count: jax.Array
    num_dropped: jax.Array
    handle: LowLatencyHandle
    num_invalid: jax.Array | None = None  # set by the public calls (backends leave it None)
