"""Which low-latency call sequences work on GPU: a probe for the split-send deadlock.

    JAX_EP_TIMEOUT_S=5 python -m jax_ep.launch -n 2 tests/gpu_ll_split_probe.py
    CASES=chain,split python -m jax_ep.launch -n 2 tests/gpu_ll_split_probe.py
    JAX_EP_LL_HOST_CALLS=1 ...   # call numbers counted by the handlers instead of the device

Runs each case with the CUDA and the reference backend and compares; prints the device's
low-latency call counters before and after each CUDA run (on 2xH200, 2026-11-23, the split
case reached a third send from a fresh buffer: see benchmarks/NOTES.md). Not a pytest module.
"""
import os
import sys
import threading
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import test_gpu as tg  # noqa: E402  (initialises jax.distributed under the launcher)

import jax_ep  # noqa: E402
from jax_ep import runtime  # noqa: E402

R = jax.device_count()
runtime.initialize(1 << 30, low_latency_bytes=2 * jax_ep.low_latency_buffer_size_hint(
    64, 512, 8 * R, 8, R, jnp.float32))
from ep import run  # noqa: E402

T, M, H, n = 32, 32, 256, 6
data = [tg._ll_inputs(100 + i, T, H, "random", 0.1) for i in range(n)]
E = data[0][3]
L = E // R
xs = np.stack([d[0] for d in data], 1)
idxs = np.stack([d[1] for d in data], 1)
ws = np.stack([d[2] for d in data], 1)
ys = np.asarray(jnp.asarray(np.random.default_rng(7).standard_normal((R, n, L, R * M, H)),
                            jnp.bfloat16))
_after = tg._after


def kw(backend):
    return dict(num_experts=E, max_tokens_per_rank=M, axis_name="ep", use_fp8=True,
                backend=backend)


def case_dispatch_chain(backend, xs, idxs, ws, ys):
    outs = []
    for i in range(n):
        outs.append(jax_ep.low_latency_dispatch(xs[i], _after(idxs[i], *outs[-1:]), **kw(backend)))
    return [(o.x_scales, o.handle.src_rank) for o in outs]


def case_combine_chain(backend, xs, idxs, ws, ys):
    o = jax_ep.low_latency_dispatch(xs[0], idxs[0], **kw(backend))
    backs = []
    for i in range(n):
        backs.append(jax_ep.low_latency_combine(_after(ys[i], *backs[-1:]), ws[i], o.handle))
    return backs


def case_split_dispatch(backend, xs, idxs, ws, ys):
    pa = jax_ep.low_latency_dispatch_send(xs[0], idxs[0], **kw(backend))
    pb = jax_ep.low_latency_dispatch_send(xs[1], idxs[1], **kw(backend))
    oa = jax_ep.low_latency_dispatch_receive(pa)
    ob = jax_ep.low_latency_dispatch_receive(pb)
    return (oa.x_scales, oa.handle.src_rank), (ob.x_scales, ob.handle.src_rank)


def case_split_dispatch_reversed(backend, xs, idxs, ws, ys):
    pa = jax_ep.low_latency_dispatch_send(xs[0], idxs[0], **kw(backend))
    pb = jax_ep.low_latency_dispatch_send(xs[1], idxs[1], **kw(backend))
    ob = jax_ep.low_latency_dispatch_receive(pb)
    oa = jax_ep.low_latency_dispatch_receive(pa)
    return (oa.x_scales, oa.handle.src_rank), (ob.x_scales, ob.handle.src_rank)


def case_split_combine(backend, xs, idxs, ws, ys):
    oa = jax_ep.low_latency_dispatch(xs[0], idxs[0], **kw(backend))
    ob = jax_ep.low_latency_dispatch(xs[1], _after(idxs[1], oa), **kw(backend))
    ca = jax_ep.low_latency_combine_send(ys[0], oa.handle)
    cb = jax_ep.low_latency_combine_send(ys[1], ob.handle)
    bb = jax_ep.low_latency_combine_receive(cb, ws[1], ob.handle)
    ba = jax_ep.low_latency_combine_receive(ca, ws[0], oa.handle)
    return ba, bb


def close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == jnp.float8_e4m3fn:
        return np.array_equal(a.view(np.uint8), b.view(np.uint8))
    if a.dtype in (jnp.bfloat16, np.float32):
        return np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2,
                           atol=1e-2)
    return np.array_equal(a, b)


from jax_ep import _native  # noqa: E402

module = _native.load()[0]
order = os.environ.get("CASES", "split,chain,split,reversed,combine,split_combine").split(",")
cases = dict(split=case_split_dispatch, chain=case_dispatch_chain,
             reversed=case_split_dispatch_reversed, combine=case_combine_chain,
             split_combine=case_split_combine)


def report_if_stuck(name, handled, done):
    """Prints the handler executions of a case still running after 15 s, past compilation (no
    GPU sync needed: a case stuck in a device wait would otherwise never say what XLA ran)."""
    if not done.wait(15.0):
        print(f"{name} still running; handler runs so far: "
              + str({k[len("jax_ep_"):]: v - handled[k]
                     for k, v in module.handler_calls().items() if v != handled[k]}),
              flush=True)


for case in [cases[c] for c in order]:
    print(f"calls before {case.__name__}: {module.low_latency_calls()}", flush=True)
    handled = module.handler_calls()
    done = threading.Event()
    threading.Thread(target=report_if_stuck, args=(case.__name__, handled, done),
                     daemon=True).start()
    try:
        got = run(lambda *a, case=case: case("cuda", *a), R, xs, idxs, ws, ys)
        done.set()
        print(f"calls after {case.__name__}: {module.low_latency_calls()}; handler runs: "
              + str({k[len("jax_ep_"):]: v - handled[k]
                     for k, v in module.handler_calls().items() if v != handled[k]}),
              flush=True)
        want = run(lambda *a, case=case: case("reference", *a), R, xs, idxs, ws, ys)
        if isinstance(want[0], tuple):  # dispatch cases: (x_scales, src_rank) pairs
            oks = []
            for (gs, gr), (ws_, wr) in zip(got, want):
                used = np.asarray(wr) >= 0
                oks.append(bool(np.array_equal(np.asarray(gr), np.asarray(wr))
                                and np.array_equal(np.asarray(gs)[used], np.asarray(ws_)[used])))
        else:
            oks = [close(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
        print(f"{case.__name__}: {'ok' if all(oks) else 'MISMATCH ' + str(oks)}", flush=True)
    except Exception as e:
        print(f"{case.__name__}: ERROR {type(e).__name__}: {str(e)[:600]}", flush=True)
        traceback.print_exc(limit=3)
        os._exit(1)
os._exit(0)
