"""The benchmarks' reading of the kernels' profile ring (benchmarks/timing.py), on made-up
stamps: rows per handler call, the retirement fallback, and the gaps between calls."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
timing = pytest.importorskip("timing")


def _ring(calls):
    """Profile ring values: calls = {row: {kernel: (enter, waited, first end, last end,
    retired)}} in ns; untouched stamps as profile_reset leaves them."""
    n, k = timing.PROFILE_PHASES, timing.PROFILE_KERNELS
    values = []
    for row in range(64):
        for kernel in timing.KERNELS + [None] * (k - len(timing.KERNELS)):
            stamps = calls.get(row, {}).get(kernel)
            values += list(stamps) if stamps else [2**64 - 1, 0, 2**64 - 1, 0, 0]
    assert len(values) == 64 * k * n
    return values


def test_timeline_of_two_calls():
    values = _ring({
        0: {"dispatch_stage": (1000, 1100, 1900, 2000, 2500),
            "dispatch_push": (3000, 3100, 8000, 9000, 9400),
            "dispatch_receive": (10000, 10100, 11000, 12000, 12300)},
        # a low-latency kernel: no retirement stamp, its last end counts
        2: {"ll_dispatch_send": (20000, 20500, 21000, 22000, 0)},
    })
    rows = timing.profile_rows(values)
    assert [r for r, _ in rows] == [0, 2]
    assert dict(rows[1][1])["ll_dispatch_send"][4] == 22000
    calls = timing.timeline(rows)
    assert calls[0] == (0.0, pytest.approx(11.3), calls[0][2])
    assert calls[1][0] == pytest.approx(19.0)
    assert calls[1][1] == pytest.approx(2.0)
    assert calls[1][2] == pytest.approx(20.0 - 12.3)


def test_empty_ring():
    assert timing.timeline(timing.profile_rows(_ring({}))) == []
