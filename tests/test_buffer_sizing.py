"""Symmetric-buffer sizing (``jax_ep._cuda.buffer_size_hint``): the extension's own formula,
which the FFI handlers also check, must cover every call of a dispatch / combine pair.

Needs the built extension, not a GPU. Lower bounds below are the row regions each kernel
stages (see ffi/kernels/buffer_layout.h); the hint may only exceed them by small headers.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_ep import _native

module, why = _native.load()
pytestmark = pytest.mark.skipif(module is None, reason=f"extension not built: {why}")


def hint(**kw):
    from jax_ep import _cuda

    return _cuda.buffer_size_hint(**kw)


def _align16(n):
    return (n + 15) // 16 * 16


def test_push_dispatch_rows_and_records_are_covered():
    # Push mode stages C rows plus one metadata record (token, k, K ids, K weights) per row.
    R, T, H, K, E, C = 2, 100, 64, 8, 16, 200
    row = H * 2
    need = C * (row + _align16(8 + 8 * K))
    assert hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R, capacity=C,
                dtype=jnp.bfloat16) >= need


def test_lean_push_landing_area_and_its_lists_are_covered():
    # The lean push (rank_major where the XLA windows are open) lands a destination's C rows
    # and their FP8 scales unpadded beside the pull stage's lists (R x T) and staged ids and
    # weights (T x K each), for any capacity.
    R, T, H, K, E = 2, 100, 256, 8, 16
    for C in (50, 200, 400):
        need = C * (H + 4 * (H // 128)) + 4 * R * T + 8 * T * K
        assert hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R, capacity=C,
                    dtype=jnp.bfloat16, fp8=True) >= need, C


def test_cached_dispatch_of_all_tokens_is_covered():
    # Combine's backward stages the source's T rows, which exceeds C rows when C < T.
    R, T, H, K, E, C = 2, 4096, 1024, 2, 4, 16
    assert hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R, capacity=C,
                dtype=jnp.float32) >= T * H * 4


def test_default_capacity_is_the_worst_case_with_alignment_padding():
    R, T, H, K, E = 4, 256, 512, 8, 64
    plain = hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R,
                 layout="expert_major")
    padded = hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R,
                  layout="expert_major", alignment=128)
    assert plain >= R * T * K * H * 2
    assert padded >= plain + (E // R) * 127 * H * 2


def test_rank_major_deepseek_shapes_fit_the_default_buffer():
    from jax_ep.runtime import DEFAULT_BUFFER_BYTES

    for R in (2, 4, 8):
        need = hint(num_tokens=4096, hidden=7168, num_topk=8, num_experts=256, num_ranks=R)
        assert R * 4096 * 7168 * 2 <= need <= DEFAULT_BUFFER_BYTES, R


@pytest.mark.parametrize("variable", ["JAX_EP_DISPATCH", "JAX_EP_COMBINE"])
def test_copy_engine_areas_count_only_when_selected(variable, monkeypatch):
    # The copy-engine dispatch lands every source's T rows (and FP8 scales); the combine
    # stages and lands T records (row + weight) per rank. Both are [R][T] areas.
    R, T, H, K, E = 4, 512, 256, 8, 32
    kw = dict(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R)
    monkeypatch.delenv("JAX_EP_DISPATCH", raising=False)
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    plain = hint(**kw)
    monkeypatch.setenv(variable, "copy")
    need = R * T * H * 2 if variable == "JAX_EP_DISPATCH" else 2 * R * T * (H * 2 + 4)
    assert need <= hint(**kw) and plain <= hint(**kw)
    if variable == "JAX_EP_COMBINE":  # larger than every other path's area here
        assert plain < need


def test_push_combine_slots_count_when_it_is_the_default(monkeypatch):
    # The push combine (rank_major's default at >= 64 CTAs) lands every source's row and
    # weight of each token: [R][T] slots, more than a small capacity's rows.
    R, T, H, K, E, C = 4, 512, 256, 8, 32, 16
    kw = dict(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R, capacity=C)
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    monkeypatch.delenv("JAX_EP_NUM_BLOCKS", raising=False)
    need = R * T * (H * 2 + 4)
    assert hint(**kw) >= need
    monkeypatch.setenv("JAX_EP_COMBINE", "pull")
    assert hint(**kw) < need
    monkeypatch.delenv("JAX_EP_COMBINE")
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")  # the pull is the default there
    assert hint(**kw) < need


@pytest.mark.parametrize("combine", [False, True])
def test_low_latency_tagged_words_never_sit_on_another_calls_records(combine):
    # Tagged words (pair headers, gate words, tags) are valid once they show the call's number:
    # a stale word must be an older call's word, never record bytes of a call with another row
    # size that could happen to show that number. So for either parity the words section is at
    # the same place whatever the row size, and it overlaps no record of either parity. A
    # combine across nodes (staged: its partial rows for other nodes staged in the region) too.
    H = 7168
    shapes = ([(2 * H, 0, False), (2 * H, 0, True)] if combine
              else [(H, 4 * (H // 128), False), (2 * H, 0, False), (4 * 8, 0, False)])
    shapes += [(4 * 2048, 0, False)]  # another hidden size, float32 rows
    R, E, M, K = 2, 256, 128, 8
    need = max(module.required_low_latency_bytes(M, H, E, K, R, 4, True),
               module.required_low_latency_bytes(M, 2048, E, K, R, 4, True))
    for buffer_bytes in (need, need + 12345 * 16, 2 * need):
        sections = {(call, shape): module.low_latency_sections(buffer_bytes, combine, call, R, E,
                                                                M, K, *shape)
                    for call in (6, 7) for shape in shapes}
        for call in (6, 7):
            words = {sections[call, shape][:2] for shape in shapes}
            assert len(words) == 1, (call, words)  # the same place for every row size
        for (call, shape), (w, wb, d, db, begin, end) in sections.items():
            assert begin <= min(w, d) and max(w + wb, d + db) <= end
            for (other_call, other), (_, _, d2, db2, _, _) in sections.items():
                assert w + wb <= d2 or d2 + db2 <= w, (call, shape, other_call, other)


def test_source_slots_areas_count_without_any_variable(monkeypatch):
    # source_slots always dispatches by copy engines (every source's T rows land here) and
    # combines by copy by default (T rows and T weights per rank land, unstaged).
    R, T, H, K, E = 4, 512, 256, 8, 32
    kw = dict(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R)
    monkeypatch.delenv("JAX_EP_DISPATCH", raising=False)
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    slots = hint(layout="source_slots", **kw)
    assert R * T * H * 2 <= slots and R * T * (H * 2 + 4) <= slots
    assert hint(**kw) <= slots


@pytest.mark.parametrize("fp8", [False, True])
def test_across_nodes_the_exchange_and_the_node_stage_are_covered(fp8):
    # The node exchange holds every other node's T rows (and their scales, ids and weights),
    # the return direction also stages T rows per node; the node-local stage dispatches
    # nodes * T tokens over the node's ranks.
    R, G, T, H, K, E = 8, 2, 256, 512, 4, 32
    N = R // G
    x_row = H if fp8 else 2 * H
    exchange = N * T * (x_row + (4 * H // 128 if fp8 else 0) + 8 * K)
    returned = 2 * N * T * 2 * H
    stage = hint(num_tokens=N * T, hidden=H, num_topk=K, num_experts=E // N, num_ranks=G,
                 fp8=fp8)
    got = hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R, fp8=fp8,
               node_size=G)
    assert got >= max(exchange, returned, stage)
    assert hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E, num_ranks=R, fp8=fp8,
                node_size=R) == hint(num_tokens=T, hidden=H, num_topk=K, num_experts=E,
                                     num_ranks=R, fp8=fp8)
