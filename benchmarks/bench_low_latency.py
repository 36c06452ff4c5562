"""Low-latency (decode) benchmark: dispatch/combine per call inside one jitted loop of N calls.

    python -m jax_ep.launch -n 2 benchmarks/bench_low_latency.py      # one process per GPU
    JAX_PLATFORMS=cpu python benchmarks/bench_low_latency.py --hidden 512 --calls 5 --rounds 1 \
        --repeats 1                                               # reference, CPU (~30 s)

Each figure is (time of one jitted program of ``--calls`` unrolled calls) / calls, median of
repeats: XLA's own launch cost is included, Python's is not. Consecutive calls depend on each
other through a zero-weighted feedback, so XLA can neither hoist nor overlap them. Baselines in
the same run: a capacity-padded ``jax.lax.all_to_all`` and ``jax.lax.ragged_all_to_all`` (XLA
runs the latter in one process only: under the launcher take it from ``--baselines-only``, a
second run without the launcher over all local GPUs, as the device script does).
The overlap row runs dispatch-send, an independent matmul, dispatch-receive: compare it with
the sum of the two alone (the matmul depends on the chained argument, so XLA cannot hoist it
out of the loop); on a GPU a second row runs the send on a second XLA stream
(``compute_on("gpu_stream:1")``) beside the matmul, and more rows put the matmul there
(``jax_ep.on_stream``; alone, as the stream call's own cost) with the send and receive, or the
whole dispatch, beside it on the program's stream, at the default CTAs and fewer. The
combine-alone row reuses one dispatch's handle for every call; the combine's split rows run
combine-send, the matmul, combine-receive ("combine send then receive": no work between, the
receive's own cost), and the ``y written`` rows write y in every call
first (packed rows), as a layer's expert GEMM leaves it in L2 for the send. The
``expert_major`` rows dispatch (and combine) the packed layout, the ``records`` rows each token
once; the expert MLP rows (GPU, ``--ffn F``) take one dispatch's FP8 rows through a SiLU MLP
per local expert: on the blocks, dequantized whole and through batched GEMMs over all L*R*M
rows, on the packed rows through grouped GEMMs (``experts.grouped_matmul``: the Mosaic GPU
kernels, and jax_ep's ``impl="cuda"``), and on the records through ``impl="cuda"`` reading them
by index.
A send cannot be timed alone: a third send waits for the receive of the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from functools import partial


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (= max tokens)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=10,
                   help="also time the chain run this many times in one program (fori_loop): "
                        "the steady state of a long run of calls; 1: off")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gemm-sms", type=int, default=None,
                   help="the independent matmul through jax_ep.experts.batched_matmul sized "
                        "for this many SMs (0: every SM); default XLA's dot")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "cuda"])
    p.add_argument("--cpu-devices", type=int, default=4)
    p.add_argument("--baselines-only", action="store_true",
                   help="only the JAX baselines (ragged_all_to_all needs one process: run it "
                        "without the launcher, over all local GPUs)")
    p.add_argument("--profile", action="store_true",
                   help="also print the kernels' phase timestamps of one call (CUDA backend)")
    p.add_argument("--rows", default="",
                   help="time only the rows whose names contain one of these comma-separated "
                        "pieces (e.g. 'matmul,16 CTAs'), or '|'-separated ones where a piece "
                        "holds a comma ('matmul alone, on a second stream|send then'); a "
                        "piece ending in '$' ends the name ('send FP8 -> matmul -> receive$' "
                        "leaves out that row's variants); empty: every row")
    p.add_argument("--ffn", type=int, default=0,
                   help="the expert MLP rows (GPU; e.g. 2048, DeepSeek-V3's): the dispatch's "
                        "rows through w_in [H, ffn] and w_out [ffn, H] per local expert, in both "
                        "layouts (each call reads every local expert's weights: use --calls 10 "
                        "--rounds 2); 0: no such rows")
    p.add_argument("--node-size", type=int, default=None,
                   help="virtual nodes of this many ranks (runtime.initialize(node_size=)): "
                        "the kernels reach other nodes' ranks by NVSHMEM puts, as over a "
                        "network; also prints the bytes that cross between nodes")
    return p.parse_args()


args = parse_args()
if "JAX_EP_RANK" not in os.environ and os.environ.get("JAX_PLATFORMS", "") == "cpu":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cpu_devices}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import _native  # noqa: E402

from timing import (  # noqa: E402
    build_line,
    call_profile,
    ep_mesh,
    gpu_events,
    host_times_reset,
    host_us_per_call,
    is_ours,
    jax_baselines,
    kernel_details,
    looped,
    print_call_profiles,
    print_phases,
    profile_body,
    progress,
    put,
    random_routing,
    seconds_per_call,
    steady_seconds_per_call,
)

AXIS = "ep"


def jax_ep_rows(record, rows, backend, x, idx_d, w, rng, shard, smap, ll, R, T, H, K, E):
    """The jax_ep operations: fused dispatch (FP8, BF16), dispatch + combine, combine alone,
    and the split dispatch around an independent matmul."""
    def dispatch_fp8(x, idx, blocks=None, layout="blocks"):
        kw = dict(ll, config=jax_ep.Config(num_blocks=blocks)) if blocks else ll
        return jax_ep.low_latency_dispatch(x, idx, use_fp8=True, layout=layout,
                                           **kw).recv_count

    def dispatch_bf16(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, use_fp8=False, **ll).recv_count

    def combine(x, idx, w, layout="blocks"):
        o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, layout=layout, **ll)
        return jax_ep.low_latency_combine(o.x, w, o.handle)

    # independent work of about the size of a decode step's attention projection
    # float32 (bfloat16-rounded values): the matmul the split-call target is stated against
    # (x is bfloat16, so XLA converts it and runs a TF32 GEMM, ~104 µs on H100/H200)
    weight = put((rng.standard_normal((R * H, H)).astype(jnp.bfloat16) / np.sqrt(H))
                 .astype(np.float32), shard)

    def matmul(x, idx, weight):  # x is the chained argument: one matmul per call
        if args.gemm_sms is not None:  # jax_ep's GEMM (TF32), sized to leave the calls SMs
            return jnp.sum(jax_ep.experts.batched_matmul(
                x.astype(weight.dtype)[None], weight[None], sm_count=args.gemm_sms,
                backend="cuda"))
        return jnp.sum(jnp.dot(x, weight, preferred_element_type=jnp.float32))

    def dispatch_overlapped(x, idx, weight, blocks=None, layout="blocks"):
        kw = dict(ll, config=jax_ep.Config(num_blocks=blocks)) if blocks else ll
        pending = jax_ep.low_latency_dispatch_send(x, idx, use_fp8=True, layout=layout, **kw)
        # the matmul after the send and the receive after the matmul: nothing else orders them
        # (profiler traces showed XLA running the receive right after the send otherwise)
        x_after, pending = jax.lax.optimization_barrier((x, pending))
        s = matmul(x_after, idx, weight)
        s, pending = jax.lax.optimization_barrier((s, pending))
        return jax_ep.low_latency_dispatch_receive(pending).recv_count, s

    def dispatch_second_stream(x, idx, weight):  # the send on a stream of XLA's own beside it
        from jax.experimental.compute_on import compute_on

        send = compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(
            lambda x, idx: jax_ep.low_latency_dispatch_send(x, idx, use_fp8=True, **ll))
        pending = send(x, idx)
        s = matmul(x, idx, weight)
        s, pending = jax.lax.optimization_barrier((s, pending))
        return jax_ep.low_latency_dispatch_receive(pending).recv_count, s

    def dispatch_beside_work(x, idx, weight, split=True, blocks=None):
        # the matmul a call on XLA's stream 1 (jax_ep.on_stream), started before the send: the
        # send and the receive (or the whole dispatch) run on the program's stream beside it;
        # blocks: their CTAs (fewer leave the GEMM more SMs)
        s = jax_ep.on_stream(matmul)(x, idx, weight)
        kw = dict(ll, config=jax_ep.Config(num_blocks=blocks)) if blocks else ll
        if not split:
            return jax_ep.low_latency_dispatch(x, idx, use_fp8=True, **kw).recv_count, s
        pending = jax_ep.low_latency_dispatch_send(x, idx, use_fp8=True, **kw)
        return jax_ep.low_latency_dispatch_receive(pending).recv_count, s

    def dispatch_fp8_split(x, idx):  # the two halves back to back: the split's own cost
        pending = jax_ep.low_latency_dispatch_send(x, idx, use_fp8=True, **ll)
        return jax_ep.low_latency_dispatch_receive(pending).recv_count

    record("jax_ep low_latency_dispatch FP8", dispatch_fp8, x, idx_d)
    if jax.default_backend() == "gpu":  # the one-call dispatch on the CTAs a split call takes
        for blocks in (16, 8):
            record(f"jax_ep low_latency_dispatch FP8, {blocks} CTAs",
                   partial(dispatch_fp8, blocks=blocks), x, idx_d)
    record("jax_ep dispatch FP8, send then receive", dispatch_fp8_split, x, idx_d)
    record("jax_ep low_latency_dispatch FP8, expert_major",
           partial(dispatch_fp8, layout="expert_major"), x, idx_d)
    record("jax_ep low_latency_dispatch FP8, records",
           partial(dispatch_fp8, layout="records"), x, idx_d)
    record("jax_ep low_latency_dispatch BF16", dispatch_bf16, x, idx_d)
    record("jax_ep dispatch BF16 + combine BF16", combine, x, idx_d, w)
    record("jax_ep dispatch BF16 + combine BF16, expert_major",
           partial(combine, layout="expert_major"), x, idx_d, w)
    if args.ffn and jax.default_backend() == "gpu":
        expert_mlp_rows(record, x, idx_d, shard, smap, ll, R, H, E)

    # combine alone: one dispatch's handle and rows, reused by every call
    from jax_ep._types import LowLatencyConfig, LowLatencyHandle

    config = LowLatencyConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=H, num_topk=K,
                              max_tokens_per_rank=T, use_fp8=False, axis_name=AXIS,
                              backend=backend)

    def handle_arrays(x, idx):
        o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, **ll)
        h = o.handle
        return (jnp.where((h.src_rank >= 0)[..., None], o.x, 0), h.topk_idx, h.send_slot,
                h.src_rank, h.src_token, h.src_k, h.recv_count, h.pair_row)

    try:
        arrays = jax.jit(smap(handle_arrays, in_specs=(P(AXIS),) * 2))(x, idx_d)

        def tuned(blocks):
            return config if blocks is None else dataclasses.replace(
                config, tuning=jax_ep.Config(num_blocks=blocks))

        def combine_alone(y, w, *h, blocks=None):
            handle = LowLatencyHandle(*h, config=tuned(blocks))
            return jax_ep.low_latency_combine(y, w, handle)

        record("jax_ep low_latency_combine BF16 (alone)", combine_alone, arrays[0], w,
               *arrays[1:], chained=1)  # returns a row of the gates: y is L*R*M rows
        if jax.default_backend() == "gpu":  # the one-call combine on the CTAs a split call takes
            record("jax_ep low_latency_combine BF16 (alone), 16 CTAs",
                   partial(combine_alone, blocks=16), arrays[0], w, *arrays[1:], chained=1)

        def combine_overlapped(x, y, w, weight, *h, blocks=None, config=None):
            handle = LowLatencyHandle(*h, config=config or tuned(blocks))
            pending = jax_ep.low_latency_combine_send(y, w, handle)
            x_after, pending = jax.lax.optimization_barrier((x, pending))
            s = matmul(x_after, None, weight)
            s, pending = jax.lax.optimization_barrier((s, pending))
            return jax_ep.low_latency_combine_receive(pending, handle), s

        def combine_split(y, w, *h):  # the halves with no work between: the sum's own cost
            handle = LowLatencyHandle(*h, config=config)
            return jax_ep.low_latency_combine_receive(
                jax_ep.low_latency_combine_send(y, w, handle), handle)

        if jax.default_backend() == "gpu":
            record("combine send then receive", combine_split, arrays[0], w, *arrays[1:],
                   chained=1)
        for blocks in ((None, 40, 32, 24, 16, 8) if jax.default_backend() == "gpu" else ()):
            record("combine send -> matmul -> receive" + (f", {blocks} CTAs" if blocks else ""),
                   partial(combine_overlapped, blocks=blocks), x, arrays[0], w, weight,
                   *arrays[1:], chained=0)

        # y written in every call before the combine, as a layer's expert GEMM writes it (the
        # rows above read the same y every call: from HBM, the matmul having evicted it from
        # L2); packed rows (expert_major), so that writing y costs ~30 MB, not the blocks' 470
        packed_config = dataclasses.replace(config, layout="expert_major")

        def packed_arrays(x, idx):
            o = jax_ep.low_latency_dispatch(x, idx, use_fp8=False, layout="expert_major", **ll)
            h = o.handle
            return (jnp.where((h.src_rank >= 0)[..., None], o.x, 0), h.topk_idx, h.send_slot,
                    h.src_rank, h.src_token, h.src_k, h.recv_count, h.pair_row)

        packed = jax.jit(smap(packed_arrays, in_specs=(P(AXIS),) * 2))(x, idx_d)

        def written(x, y):  # a new y of the same values (no kernel fuses into a custom call)
            return y * (1 + 0 * x[0, 0]).astype(y.dtype)

        def written_matmul(x, y, weight):
            x_after, y = jax.lax.optimization_barrier((x, written(x, y)))
            return matmul(x_after, None, weight), y[0, :1]

        def written_combine_matmul(x, y, w, weight, *h):
            out = jax_ep.low_latency_combine(written(x, y), w,
                                             LowLatencyHandle(*h, config=packed_config))
            x_after, out = jax.lax.optimization_barrier((x, out))
            return out, matmul(x_after, None, weight)

        def written_combine_overlapped(x, y, w, weight, *h):
            handle = LowLatencyHandle(*h, config=packed_config)
            pending = jax_ep.low_latency_combine_send(written(x, y), w, handle)
            x_after, pending = jax.lax.optimization_barrier((x, pending))
            s = matmul(x_after, None, weight)
            s, pending = jax.lax.optimization_barrier((s, pending))
            return jax_ep.low_latency_combine_receive(pending, handle), s

        def packed_overlapped(x, y, w, weight, *h):
            return combine_overlapped(x, y, w, weight, *h, config=packed_config)

        record("combine send -> matmul -> receive, expert_major", packed_overlapped, x,
               packed[0], w, weight, *packed[1:], chained=0)
        record("y written -> matmul", written_matmul, x, packed[0], weight, chained=0,
               marker=None)
        record("y written -> combine -> matmul", written_combine_matmul, x, packed[0], w,
               weight, *packed[1:], chained=0)
        record("y written -> combine send -> matmul -> receive", written_combine_overlapped, x,
               packed[0], w, weight, *packed[1:], chained=0)
    except Exception as e:
        rows.append(("jax_ep low_latency_combine BF16 (alone)",) + (float("nan"),) * 3)
        if jax.process_index() == 0:
            print(f"combine alone FAILED: {type(e).__name__}: {str(e)[:400]}")
    record("independent matmul alone", matmul, x, idx_d, weight, chained=0, marker=None,
           kernels=True)
    record("send FP8 -> matmul -> receive", dispatch_overlapped, x, idx_d, weight, chained=0)
    record("send FP8 -> matmul -> receive, records",
           partial(dispatch_overlapped, layout="records"), x, idx_d, weight, chained=0)
    if jax.default_backend() == "gpu":  # the split dispatch's kernel beside the matmul
        # the default: config.split_dispatch_blocks, by device
        for blocks in (32, 24, 20, 16, 12, 8):
            record(f"send FP8 -> matmul -> receive, {blocks} CTAs",
                   partial(dispatch_overlapped, blocks=blocks), x, idx_d, weight, chained=0)
    if jax.default_backend() == "gpu":
        record("send FP8 on a second stream, matmul beside it -> receive",
               dispatch_second_stream, x, idx_d, weight, chained=0)
        # the async call's own cost: the matmul on stream 1 with nothing beside it
        record("matmul alone, on a second stream", jax_ep.on_stream(matmul), x, idx_d, weight,
               chained=0, marker=None)
        record("matmul on a second stream, send FP8 -> receive beside it",
               dispatch_beside_work, x, idx_d, weight, chained=0)
        record("matmul on a second stream, send FP8 -> receive beside it, 32 CTAs",
               partial(dispatch_beside_work, blocks=32), x, idx_d, weight, chained=0)
        record("matmul on a second stream, dispatch FP8 (one call) beside it",
               partial(dispatch_beside_work, split=False), x, idx_d, weight, chained=0)
        # fewer CTAs: the GEMM, left the other SMs, loses about the SM-time the call holds
        for blocks in (32, 16, 8):
            record(f"matmul on a second stream, dispatch FP8 (one call) beside it, {blocks} CTAs",
                   partial(dispatch_beside_work, split=False, blocks=blocks), x, idx_d, weight,
                   chained=0)


def expert_mlp_rows(record, x, idx_d, shard, smap, ll, R, H, E):
    """A SiLU MLP per local expert on one dispatch's FP8 rows, in both layouts (the rows are
    dispatched once; each call dequantizes them and runs both GEMMs)."""
    from jax_ep import experts

    F = args.ffn

    @partial(jax.jit, out_shardings=(shard, shard))
    def weights(key):
        k1, k2 = jax.random.split(key)
        return ((jax.random.normal(k1, (E, H, F)) / np.sqrt(H)).astype(jnp.bfloat16),
                (jax.random.normal(k2, (E, F, H)) / np.sqrt(F)).astype(jnp.bfloat16))

    w_in, w_out = weights(jax.random.key(1))

    def rows_of(layout):
        def fn(x, idx):
            o = jax_ep.low_latency_dispatch(x, idx, use_fp8=True, layout=layout, **ll)
            if layout == "records":  # unused records: any bits on CUDA (never read)
                return o.x, o.x_scales, o.recv_count, o.handle.record_rows()
            keep = (o.handle.src_rank >= 0)[..., None]  # unused rows: any bits on CUDA
            return jnp.where(keep, o.x, jnp.zeros((), o.x.dtype)), o.x_scales, o.recv_count
        return jax.jit(smap(fn, in_specs=(P(AXIS),) * 2))(x, idx_d)

    def on_blocks(rows, scales, counts, w_in, w_out):
        h = jax_ep.dequantize_fp8(rows, scales, jnp.bfloat16)  # [L, R*M, H]
        a = jax.nn.silu(experts.batched_matmul(h, w_in))
        return experts.batched_matmul(a, w_out)[:, :1, :1]

    def on_packed(rows, scales, counts, w_in, w_out, impl="auto"):
        h = jax_ep.dequantize_fp8(rows, scales, jnp.bfloat16)  # [R*M*min(K, L), H]
        a = jax.nn.silu(experts.grouped_matmul(h, w_in, counts, impl=impl))
        return experts.grouped_matmul(a, w_out, counts, impl=impl)[:1, :1]

    def on_records(rows, scales, counts, index, w_in, w_out):
        h = jax_ep.dequantize_fp8(rows, scales, jnp.bfloat16)  # [R*M, H]: each token once
        a = jax.nn.silu(experts.grouped_matmul(h, w_in, counts, impl="cuda", row_index=index))
        return experts.grouped_matmul(a, w_out, counts, impl="cuda")[:1, :1]

    blocks, packed = rows_of("blocks"), rows_of("expert_major")
    records = rows_of("records")
    if jax.process_index() == 0:
        print(f"expert MLP rows: {E // R} local experts, ffn {F}; rows per rank: blocks "
              f"{blocks[0].size // R // H}, packed {packed[0].size // R // H}, used "
              f"{int(np.asarray(packed[2].addressable_shards[0].data).sum())} on rank "
              f"{jax.process_index()}", flush=True)
    record("expert MLP on the blocks (dequantize, batched GEMMs)", on_blocks, *blocks, w_in,
           w_out, chained=0, marker=None)
    record("expert MLP on expert_major rows (dequantize, grouped GEMMs: mgpu)", on_packed,
           *packed, w_in, w_out, chained=0, marker=None)
    record("expert MLP on expert_major rows (dequantize, grouped GEMMs: cuda)",
           partial(on_packed, impl="cuda"), *packed, w_in, w_out, chained=0, marker=None)
    record("expert MLP on records (dequantize, grouped GEMMs by index: cuda)", on_records,
           *records, w_in, w_out, chained=0, marker=None)


def main():
    if "JAX_EP_RANK" in os.environ:
        from jax_ep import launch

        launch.init_distributed()
    R, T, H, K, E = jax.device_count(), args.tokens, args.hidden, args.topk, args.experts
    L = E // R
    if args.backend != "reference" and jax.default_backend() == "gpu" and not args.baselines_only:
        from jax_ep import runtime

        across = args.node_size is not None and args.node_size < R
        runtime.initialize(
            low_latency_bytes=jax_ep.low_latency_buffer_size_hint(T, H, E, K, R,
                                                                  across_nodes=across),
            node_size=args.node_size)
    backend = jax_ep.api._resolve_backend(args.backend)
    _, shard, smap = ep_mesh(R, AXIS)
    rng = np.random.default_rng(0)
    idx, x, w, idx_d = random_routing(rng, R, T, H, E, K, shard)
    ll = dict(num_experts=E, max_tokens_per_rank=T, axis_name=AXIS, backend=args.backend)
    rows, profiles, call_profiles, details = [], [], [], []
    wanted = [piece.strip() for piece in args.rows.split("|" if "|" in args.rows else ",")
              if piece.strip()]

    def record(name, f, *a, chained=1, marker=is_ours, kernels=False):
        """Times f; with --profile on a GPU also its kernels' phases (jax_ep's) and the per-call
        GPU time of the kernels `marker` picks (None: none); `kernels`: on a GPU also every
        kernel's launch details (how many SMs a GEMM leaves beside it). Rows --rows leaves
        out: skipped."""
        if wanted and not any(name.endswith(piece[:-1]) if piece.endswith("$") else piece in name
                              for piece in wanted):
            return
        try:
            looped_f = jax.jit(smap(looped(f, args.calls, chained=chained),
                                    in_specs=(P(AXIS),) * len(a)))
            host_times_reset()
            t = seconds_per_call(looped_f, *a, calls=args.calls, repeats=args.repeats)
            host = host_us_per_call()
            steady = steady_seconds_per_call(
                lambda g: jax.jit(smap(g, in_specs=(P(AXIS),) * len(a))), f, *a,
                calls=args.calls, chained=chained, rounds=args.rounds,
                repeats=args.repeats) * 1e6
            gpu = None
            if args.profile and jax.default_backend() == "gpu" and marker is not None:
                if marker is is_ours and backend == "cuda":  # its kernels' phases
                    profiles.append((name, profile_body(f, chained, AXIS, smap, a)))
                gpu = call_profile(gpu_events(looped_f, *a), args.calls, marker)
                call_profiles.append((name, gpu))
            rows.append((name, t * 1e6, steady, gpu["cycle"] if gpu else float("nan"), host))
            progress(name, t * 1e6, steady)
            if kernels and jax.default_backend() == "gpu":
                details.append((name, kernel_details(looped_f, *a)))
        except Exception as e:  # a failing row must not hide the others
            rows.append((name,) + (float("nan"),) * 4)
            if jax.process_index() == 0:
                print(f"{name} FAILED: {type(e).__name__}: {str(e)[:400]}")

    if not args.baselines_only:
        jax_ep_rows(record, rows, backend, x, idx_d, w, rng, shard, smap, ll, R, T, H, K, E)

    # baselines: ragged_all_to_all (one process only) and a capacity-padded all_to_all of the
    # deduplicated tokens
    dest = idx.reshape(R, T, K) // L
    in_rank = (dest[..., None] == np.arange(R)).any(2)
    jax_baselines(R, H, in_rank, in_rank.sum(1), x, shard, record, AXIS)

    if jax.process_index() == 0:
        print(f"\n{R}×{jax.devices()[0].device_kind} backend={backend} T={T}/rank H={H} "
              f"top-{K} of {E}; per call, jitted loop of {args.calls}")
        print(build_line())
        module = _native.load()[0] if backend == "cuda" else None
        if module is not None and hasattr(module, "whole_lines"):
            print("record lines read as they land: " +
                  ("yes" if module.whole_lines() else
                   "no (GPUs of this node not all joined by NVLink): the calls wait for the "
                   "senders' arrival"))
        if args.node_size is not None:
            # records put to ranks of other nodes, per rank: one per (token, distinct rank);
            # the combine sends one partial row per (token, expert rank) back
            node = np.arange(R) // args.node_size
            remote = (in_rank & (node[None, None, :] != node[:, None, None])).sum() / R
            fp8, bf16 = H + 4 * (H // 128), 2 * H
            print(f"virtual nodes of {args.node_size}: {remote / T:.2f} records per token cross "
                  f"nodes; per rank and call {remote * fp8 / 1e6:.2f} MB FP8 / "
                  f"{remote * bf16 / 1e6:.2f} MB BF16 dispatched, {remote * bf16 / 1e6:.2f} MB "
                  "BF16 combined back, plus 8 bytes per (token, k) per remote rank of headers "
                  "or gate words")
        steady_head = f"{args.rounds}×{args.calls} calls"
        print(f"| {'operation':40s} | {'µs per call':>11s} | {steady_head:>15s} | "
              f"{'GPU µs/call':>11s} | {'host µs/call':>12s} |")
        print(f"|{'-' * 42}|{'-' * 13}|{'-' * 17}|{'-' * 13}|{'-' * 14}|")
        for name, us, steady, cycle, host in rows:
            print(f"| {name:40s} | {us:11.1f} | {steady:15.1f} | {cycle:11.1f} | {host:12.1f} |")
        print("µs per call: wall clock of the chained program / calls (its launch included); "
              f"{steady_head}: the same chain {args.rounds} times in a fori_loop, wall clock / "
              "all calls (--rounds; the launch spread over them); GPU µs/call: the GPU's cycle "
              "per call in a profiler trace of the first program (--profile; details below); "
              "host µs/call: median host time of jax_ep's handlers per call (enqueueing it)")
        for name, found in details:  # CUPTI's launch details of the row's kernels
            for kernel, text in sorted(found.items()):
                print(f"{name}: {kernel[:48]} {text}")
    # every rank (a split combine's sum on one waits for the other's send); rows of several
    # ops (a split call beside a GEMM) too
    if profiles:
        print_phases(profiles)
    print_call_profiles(call_profiles)


if __name__ == "__main__":
    main()
