"""Expert GEMMs of one SwiGLU MoE layer on one GPU: jax.lax.ragged_dot vs the Mosaic-GPU
custom_vjp (``swiglu_mlp(impl="mgpu")``) vs the capacity-padded batched einsum
(``swiglu_mlp_padded``).

Shapes (L local experts, M expert_major rows, H hidden, F expert FFN width): M holds
round(M / 1.25) useful (token, k) rows spread uniformly at random over the L experts, each
group padded to a multiple of 128 (``expert_alignment=128``) with zero rows, the rest of M is
trailing padding. Forward = 3 GEMMs, forward+backward = 9. "useful TFLOP/s" counts only the
useful rows (2 * rows * H * F per GEMM); padding rows are work the path did beyond that.
Times are the median of --runs calls after warm-up, each call waited on with
block_until_ready.

    python benchmarks/bench_expert_gemm.py            # the table (~1 min on an H100)
    python benchmarks/bench_expert_gemm.py --sweep    # sweep mgpu block configs, then the table

--sweep times each Mosaic-GPU kernel (fwd, dx, dw for the gate/up and the down weights) at the
DeepSeek-V3 shape over block configs, prints the best ones as ``TUNED_CONFIGS`` entries for
jax_ep/experts.py, and uses them for the table's mgpu rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import experts
from jax_ep.experts import GemmConfig

# "tiny" is a smoke test of the script itself (runs on CPU too, where mgpu rows report errors).
SHAPES = {"small": (32, 16384, 4096, 1024), "large": (128, 40960, 7168, 2048),
          "tiny": (4, 1280, 128, 128)}
ALIGN = 128
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def describe(e):
    """One line naming an exception (its message can be empty or span pages)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def timed(f, *a, runs):
    """Median seconds of f(*a) over `runs` calls after two warm-up calls (compilation)."""
    for _ in range(2):
        jax.block_until_ready(f(*a))
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def problem(shape, seed=0):
    """Inputs of one layer: rows, weights, group sizes, real rows per expert, cotangent."""
    L, M, H, F = shape
    useful = round(M / 1.25)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(useful, [1 / L] * L)
    aligned = -(-counts // ALIGN) * ALIGN
    ends = np.minimum(np.cumsum(aligned), M)  # dispatch clips groups to the capacity
    sizes = np.diff(ends, prepend=0)
    real = np.minimum(counts, sizes)
    mask = np.zeros(M, bool)
    for s, r in zip(ends - sizes, real):
        mask[s:s + r] = True
    k = jax.random.split(jax.random.key(seed), 5)
    rows = jax.random.normal(k[0], (M, H), jnp.bfloat16) * jnp.asarray(mask, jnp.bfloat16)[:, None]
    w_gate = (jax.random.normal(k[1], (L, H, F), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
    w_up = (jax.random.normal(k[2], (L, H, F), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(k[3], (L, F, H), jnp.float32) * F ** -0.5).astype(jnp.bfloat16)
    ct = jax.random.normal(k[4], (M, H), jnp.bfloat16)
    return dict(rows=rows, weights=(w_gate, w_up, w_down), gs=jnp.asarray(sizes, jnp.int32),
                real=jnp.asarray(real, jnp.int32), ct=ct, useful=int(real.sum()),
                grouped=int(sizes.sum()), dropped=int(counts.sum() - real.sum()), mask=mask)


# ----------------------------------------------------------------------------- sweep


def _fwd_dx_candidates():
    # (block_m, block_n, block_k, max_concurrent_steps), most likely first; then grid_block_n.
    return [(128, 128, 64, 4), (128, 128, 64, 5), (128, 128, 64, 3), (192, 128, 64, 4),
            (128, 64, 64, 6), (64, 128, 64, 6), (128, 128, 128, 2)]


def _dw_candidates():
    return [(128, 128, 64, 4), (128, 128, 64, 2), (128, 128, 128, 2), (128, 128, 128, 3),
            (64, 128, 64, 4), (128, 64, 64, 4), (64, 64, 64, 6)]


def _kernel_fn(kind, cfg):
    if kind == "dw":
        return jax.jit(lambda x, dy, gs: experts._mgpu_transposed_ragged_dot(x, dy, gs, cfg))
    return jax.jit(lambda a, w, gs: experts._mgpu_ragged_dot(a, w, gs, cfg, kind == "dx"))


def _sweep_kernel(kind, name, args, mkn, useful, deadline, runs):
    """Best config of one kernel: stage 1 over block shapes, stage 2 over grid_block_n."""
    M, K, N = mkn
    results = {}

    def trial(cfg):
        if cfg in results or not experts.config_fits(kind, cfg, M, K, N):
            return
        if time.perf_counter() > deadline:
            log(f"  {kind} {name} {tuple(cfg)}: skipped (sweep time budget spent)")
            return
        try:
            t = timed(_kernel_fn(kind, cfg), *args, runs=runs)
        except Exception as e:  # noqa: BLE001 - a config that fails is just skipped
            log(f"  {kind} {name} {tuple(cfg)}: failed: {describe(e)}")
            return
        results[cfg] = t
        log(f"  {kind:3s} {name:7s} K={K} N={N} {tuple(cfg)}: {t * 1e3:7.3f} ms "
            f"{2 * useful * K * N / t / 1e12:6.1f} useful TFLOP/s")

    for bm, bn, bk, steps in _dw_candidates() if kind == "dw" else _fwd_dx_candidates():
        trial(GemmConfig(bm, bn, bk, steps, 4))
    if results:
        top = min(results, key=results.get)
        for gbn in (1, 2, 8, 16):
            trial(top._replace(grid_block_n=gbn))
    if not results:
        log(f"BEST {kind} {name}: none ran")
        return None
    top = min(results, key=results.get)
    log(f"BEST {kind} {name} K={K} N={N}: {tuple(top)} {results[top] * 1e3:.3f} ms "
        f"({2 * useful * K * N / results[top] / 1e12:.1f} useful TFLOP/s)")
    return top


def sweep(shape, seconds, runs):
    """Best config per (pass, K, N) of the layer's 6 kernels (fwd, dx, dw for the gate/up and
    the down weights); stops trying configs at the deadline, keeping the best so far."""
    L, M, H, F = shape
    p = problem(shape)
    gs, useful = p["gs"], p["useful"]
    end = time.perf_counter() + seconds
    log(f"sweep at L={L} M={M} H={H} F={F} ({useful} useful rows), budget {seconds:.0f} s; "
        "config = (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)")
    best = {}
    left = 6  # kernels still to sweep; each gets an equal share of the time left
    for name, (K, N) in (("gate/up", (H, F)), ("down", (F, H))):
        k = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
        w = (jax.random.normal(k[1], (L, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
        dy = jax.random.normal(k[2], (M, N), jnp.bfloat16)
        args = {"fwd": (x, w, gs), "dx": (dy, w, gs), "dw": (x, dy, gs)}
        for kind in ("fwd", "dx", "dw"):
            deadline = time.perf_counter() + (end - time.perf_counter()) / left
            left -= 1
            top = _sweep_kernel(kind, name, args[kind], (M, K, N), useful, deadline, runs)
            if top is not None:
                best[(kind, K, N)] = top
    print("\nTUNED_CONFIGS entries for jax_ep/experts.py:", flush=True)
    for key, cfg in best.items():
        print(f"    {key!r}: GemmConfig{tuple(cfg)},", flush=True)
    return best


# ----------------------------------------------------------------------------- table


def variants(shape, p, args, tuned):
    """name -> (forward fn, note)."""
    L, M, H, F = shape
    gs, real = p["gs"], p["real"]
    capacity = -(-int(1.25 * p["useful"] / L) // 64) * 64
    out = {
        "ragged_dot": (lambda *w: experts.swiglu_mlp(*w, gs, impl="ragged_dot"),
                       f"{p['grouped']} rows in groups"),
        "mgpu": (lambda *w: experts.swiglu_mlp(*w, gs, impl="mgpu", mgpu_configs=tuned),
                 f"fwd/dx: all {M} rows (tiles past the groups compute, store nothing); "
                 f"dw: {p['grouped']}"),
        f"padded C={capacity}": (
            lambda *w: experts.swiglu_mlp_padded(*w, gs, capacity=capacity,
                                                 rows_per_expert=real)[0],
            f"{L * capacity} rows"),
    }
    return out, capacity


def run_table(shapes, tuned, runs, ragged_large):
    table = []
    for label in shapes:
        shape = SHAPES[label]
        L, M, H, F = shape
        p = problem(shape)
        args = (p["rows"], *p["weights"])
        log(f"shape {label} L={L} M={M} H={H} F={F}: {p['useful']} useful rows, "
            f"{p['grouped']} rows in groups (alignment {ALIGN}), {p['dropped']} dropped by "
            f"dispatch clipping; auto picks "
            f"{experts._choose('auto', p['rows'], p['weights'][0])[0]}")
        fwd_flops = 3 * 2 * p["useful"] * H * F
        vs, capacity = variants(shape, p, args, tuned)
        _, over = experts.to_padded(p["rows"], p["gs"], capacity, rows_per_expert=p["real"])
        log(f"  padded C={capacity}: {int(over)} useful rows over capacity (dropped)")
        outputs = {}
        for name, (f, note) in vs.items():
            if name == "ragged_dot" and label == "large" and not ragged_large:
                log(f"  {name}: skipped (XLA runs out of memory autotuning it at this shape; "
                    "--ragged-large tries)")
                table.append((label, name, "-", "-", "-", "-", "skipped"))
                continue
            fwd = jax.jit(f)
            fwd_bwd = jax.jit(lambda ct, *a, f=f: jax.vjp(f, *a)[1](ct))
            row = [label, name]
            for what, g, flops in (("fwd", fwd, fwd_flops), ("fwd+bwd", fwd_bwd, 3 * fwd_flops)):
                try:
                    t = timed(g, *((p["ct"],) if g is fwd_bwd else ()), *args, runs=runs)
                    row += [f"{t * 1e3:.2f}", f"{flops / t / 1e12:.1f}"]
                    log(f"  {name} {what}: {t * 1e3:.2f} ms, {flops / t / 1e12:.1f} useful "
                        "TFLOP/s")
                except Exception as e:  # noqa: BLE001 - report and go on with the others
                    row += ["err", "err"]
                    log(f"  {name} {what}: FAILED {describe(e)}")
                    if "--verbose" in sys.argv:
                        traceback.print_exc()
            try:
                outputs[name] = np.asarray(fwd(*args).astype(jnp.float32))[p["mask"]]
            except Exception:  # noqa: BLE001 - already reported above
                pass
            row.append(note)
            table.append(tuple(row))
        ref_name = "ragged_dot" if "ragged_dot" in outputs else next(iter(outputs), None)
        for name, y in outputs.items():
            if name != ref_name:
                ref = outputs[ref_name]
                err = float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-6))
                log(f"  check: max|{name} - {ref_name}| / max|{ref_name}| on useful rows = "
                    f"{err:.2e} (bf16 outputs; padded drops rows over capacity)")
    print("\n| shape | variant | fwd ms | fwd useful TFLOP/s | fwd+bwd ms "
          "| fwd+bwd useful TFLOP/s | rows computed |", flush=True)
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print("| " + " | ".join(str(c) for c in r) + " |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="sweep mgpu block configs first")
    ap.add_argument("--sweep-seconds", type=float, default=120.0,
                    help="time budget of the sweep (the whole script must stay < 4 min)")
    ap.add_argument("--sweep-runs", type=int, default=5)
    ap.add_argument("--sweep-shape", default="large", choices=sorted(SHAPES))
    ap.add_argument("--shapes", default="small,large", help="comma-separated: small, large")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ragged-large", action="store_true",
                    help="also try lax.ragged_dot at the large shape (OOMs in autotuning)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    a = ap.parse_args()
    dev = jax.devices()[0]
    log(f"jax {jax.__version__}, {dev.device_kind} ({dev.platform}, compute capability "
        f"{getattr(dev, 'compute_capability', '?')}), hopper mgpu path: "
        f"{experts._is_hopper_gpu()}")
    tuned = {}
    if a.sweep:
        try:
            tuned = sweep(SHAPES[a.sweep_shape], a.sweep_seconds, a.sweep_runs)
        except Exception as e:  # noqa: BLE001
            log(f"sweep FAILED {describe(e)}")
    run_table([s for s in a.shapes.split(",") if s], tuned, a.runs, a.ragged_large)
    log("done")


if __name__ == "__main__":
    main()
