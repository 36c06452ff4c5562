"""Shared by the benchmarks: placing global inputs, and timing calls as XLA runs them."""

from __future__ import annotations

import re
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def put(array, sharding):
    """A global NumPy array (identical on every process) placed with `sharding`."""
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def ep_mesh(R, axis):
    """(mesh, sharding over the axis, shard_map with out_specs P(axis)) for R devices."""
    mesh = jax.make_mesh((R,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    smap = partial(jax.shard_map, mesh=mesh, out_specs=P(axis), check_vma=False)
    return mesh, NamedSharding(mesh, P(axis)), smap


def random_routing(rng, R, T, H, E, K, shard):
    """Random top-K of E routing for R ranks of T tokens: (ids as NumPy, x bf16, gates, ids),
    the last three placed with `shard`."""
    idx = np.argsort(-rng.standard_normal((R * T, E)), axis=-1)[:, :K].astype(np.int32)
    x = put(rng.standard_normal((R * T, H)).astype(jnp.bfloat16), shard)
    w = put(rng.random((R * T, K)).astype(np.float32), shard)
    return idx, x, w, put(idx, shard)


def looped(body, calls, chained=0, rounds=1):
    """A function running `calls` calls of body(*a), unrolled in one program.

    body returns outputs of the operation as it made them (any pytree, the smaller the better:
    they are kept to the chain's end), not a value computed from them. Each call's operands
    pass with the previous call's outputs through an optimization barrier, so XLA can neither
    hoist, merge nor overlap the calls, and the chain adds no kernel of its own between them
    (a zero carried arithmetically from one call to the next added a convert and an add per
    call, ~7 µs in a 20 µs call). One fusion at the chain's end reads a value of every call's
    outputs, so none is dropped as unused. XLA keeps the barriers past its common-subexpression
    pass from jax 0.11 on (jax 0.10's XLA:CPU merged identical calls of such a chain). The
    loop is unrolled in Python rather than a `fori_loop`: XLA:GPU reads a while loop's
    predicate back to the host every iteration, which would add tens of microseconds of loop
    overhead to every call. `rounds` > 1 runs that unrolled chain `rounds` times in a
    `fori_loop` (calls * rounds calls in all): the program's fixed cost (0.1–0.2 ms over two
    processes for a low-latency chain, benchmarks/program_launch.py) and the predicate's
    read-back are then spread over that many calls, which measures the steady state of a long
    run of calls. The program returns (the first row of operand
    `chained`, that end value): a small output whatever the operands' sizes.
    """

    def chain(operands, seen):
        kept = []
        for _ in range(calls):
            operands, out = jax.lax.optimization_barrier((operands, body(*operands)))
            kept += jax.tree.leaves(out)
        firsts = [jnp.ravel(v)[:1].astype(jnp.float32) for v in kept if v.size]
        return operands, seen + sum(firsts, jnp.zeros((1,), jnp.float32))

    def run(*a):
        state = (tuple(a), jnp.zeros((1,), jnp.float32))
        if rounds > 1:
            state = jax.lax.fori_loop(0, rounds, lambda _, s: chain(*s), state)
        else:
            state = chain(*state)
        operands, seen = state
        return operands[chained][:1], seen

    return run


def steady_seconds_per_call(wrap, body, *a, calls, chained, rounds, repeats):
    """seconds_per_call of the chain of `calls` run `rounds` times in one program (looped's
    rounds), NaN when rounds <= 1; wrap(f) jits f as the benchmark runs it (its shard_map)."""
    if rounds <= 1:
        return float("nan")
    f = wrap(looped(body, calls, chained=chained, rounds=rounds))
    return seconds_per_call(f, *a, calls=calls * rounds, repeats=repeats)


def progress(name, us, steady_us):
    """One line on stderr (process 0) as each row is measured: a run cut short by its time
    limit still shows the rows it measured (the table comes at the end)."""
    if jax.process_index() == 0:
        print(f"measured {name}: {us:.1f} µs per call, {steady_us:.1f} steady", file=sys.stderr,
              flush=True)


def seconds_per_call(f, *a, calls, repeats):
    """Median over `repeats` of (time of f(*a)) / calls, after one warm-up (compilation)."""
    jax.block_until_ready(f(*a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def enqueue_seconds_per_call(f, *a, calls, repeats):
    """Median over `repeats` of the time f(*a) takes to return (XLA's thread enqueueing the
    program: the thunks run on the caller's thread) / calls, each run waited for before the
    next. Near seconds_per_call, the chain is bound by the host, not the GPU."""
    jax.block_until_ready(f(*a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = f(*a)
        times.append((time.perf_counter() - t0) / calls)
        jax.block_until_ready(out)
    return float(np.median(times))


# Slots of Control::profile (ffi/kernels/buffer_layout.h, ProfileSlot).
KERNELS = ["dispatch_stage", "dispatch_gather", "cached_stage", "cached_gather",
           "combine_stage", "combine_reduce", "dispatch_fused", "ll_dispatch_send",
           "ll_dispatch_receive", "ll_combine_send", "ll_combine_receive", "ll_dispatch_slots"]
PROFILE_KERNELS = 16  # kProfileKernels: slots per row of the profile ring
PROFILE_PHASES = 5  # kProfilePhases: enter, waited, first end, last end, retired


def _native_module():
    from jax_ep import _native

    return _native.load()[0]


def build_line():
    """The extension the run times, and whether it was built from this checkout's sources."""
    from jax_ep import _native

    return _native.build_line()


def host_times_reset():
    """Forgets the handlers' recorded host times (CUDA backend; no-op without the extension)."""
    module = _native_module()
    if module is not None:
        module.handler_host_times(reset=True)
        if hasattr(module, "copy_engine_host_times"):
            module.copy_engine_host_times(reset=True)


def copy_host_breakdown():
    """(host µs per call, {kind: (host calls, µs) per call}) of the copy-engine paths' host
    calls (guard, fork, join, graph launch / update / build) since
    host_times_reset(), or None where none ran. Host µs per call is the median execution of the
    handler that ran most; a kind's µs is its calls per execution times its median call, so
    that a call that blocked on a full queue does not swamp it (a mean would)."""
    module = _native_module()
    if module is None or not hasattr(module, "copy_engine_host_times"):
        return None
    kinds = module.copy_engine_host_times()
    recorded = max(module.handler_host_times().values(), key=len, default=[])
    if not recorded or not any(calls for calls, _ in kinds.values()):
        return None
    n = len(recorded)
    return float(np.median(recorded)) / 1e3, {
        kind: (calls / n, calls / n * float(np.median(ns)) / 1e3 if len(ns) else 0.0)
        for kind, (calls, ns) in kinds.items() if calls}


def host_us_per_call():
    """Host time XLA's thread spent in jax_ep's handlers per call since host_times_reset(): the
    median execution of each custom call that ran, summed over them (a row calling dispatch
    and combine adds both), in µs; NaN where none ran. The median leaves out executions that
    blocked because the GPU's queue was full, so this is what enqueueing a call costs."""
    module = _native_module()
    times = module.handler_host_times() if module is not None else {}
    if not times:
        return float("nan")
    return sum(float(np.median(ns)) for ns in times.values()) / 1e3


def after_barrier(body, chained, axis_name):
    """body, after an all-reduce that every rank must reach: the profiled call then starts on
    all ranks together, whatever the skew between the processes' launches."""

    def run(*a):
        a = list(a)
        meet = jax.lax.psum(a[chained].reshape(-1)[0].astype(np.float32), axis_name)
        a[chained] = a[chained] + (meet * 0).astype(a[chained].dtype)
        return body(*a)

    return run


def profile_rows(values):
    """The profile ring as [(row, [(kernel, (enter, waited, first end, last end, retired)
    ns)])] for the rows that hold stamps (one row per handler call since the reset). Kernels
    that stamp no retirement get their last end there."""
    n = PROFILE_PHASES
    per_row = n * PROFILE_KERNELS
    rows = []
    for r in range(len(values) // per_row):
        v = values[r * per_row:(r + 1) * per_row]
        used = [(k, tuple(v[n * i: n * i + 4]) + (max(v[n * i + 3], v[n * i + 4]),))
                for i, k in enumerate(KERNELS) if v[n * i + 3] != 0]
        if used:
            rows.append((r, used))
    return rows


def _stamped_rows(f, *a):
    """profile_rows of one run of f, after a warm-up (the CUDA kernels' phase stamps)."""
    from jax_ep import _native

    module = _native.load()[0]
    jax.block_until_ready(f(*a))
    module.profile_reset()
    jax.block_until_ready(f(*a))
    return profile_rows(module.profile_read())


def ring_cycles(f, *a):
    """Runs f once (after a warm-up) and returns the µs from one call's kernel entering to the
    next call's (the first block of the kernel that most calls stamp), from the kernels' own
    stamps in the profile ring: the GPU's cycle without a profiler's cost on the host. f's
    handler calls must fit the ring (kProfileCalls - 1 rows; a low-latency call takes two,
    one per half) or older calls' stamps mix in. Empty without the CUDA extension."""
    try:
        rows = _stamped_rows(f, *a)
    except (ImportError, AttributeError, TypeError):
        return np.zeros(0)
    enters = {}
    for _, row in rows:
        for kernel, v in row:
            enters.setdefault(kernel, []).append(v[0])
    if not enters:
        return np.zeros(0)
    most = max(enters.values(), key=len)
    return np.diff(sorted(most)) / 1e3


def kernel_phases(f, *a):
    """Runs f once (after a warm-up) and returns [(kernel, (enter, waited, first end, last
    end, retired) µs from the earliest start)] for the kernels it ran, from the phase
    timestamps the CUDA kernels write (rank-local clock)."""
    used = [u for _, row in _stamped_rows(f, *a) for u in row]
    if not used:
        return []
    t0 = min(v[0] for _, v in used)
    return [(k, tuple((x - t0) / 1e3 for x in v)) for k, v in sorted(used, key=lambda u: u[1][0])]


def profile_body(body, chained, axis_name, smap, a):
    """kernel_phases of one call of body, started after a barrier; smap(f, in_specs=...) wraps
    f in the benchmark's shard_map."""
    in_specs = (jax.sharding.PartitionSpec(axis_name),) * len(a)
    one = jax.jit(smap(looped(after_barrier(body, chained, axis_name), 1, chained),
                       in_specs=in_specs))
    return kernel_phases(one, *a)


def _profiled(f, *a):
    """f run once (after a warm-up) under the JAX profiler: its ProfileData, None if the
    profiler wrote nothing."""
    import glob
    import os
    import tempfile

    jax.block_until_ready(f(*a))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        jax.block_until_ready(f(*a))
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return jax.profiler.ProfileData.from_file(paths[0]) if paths else None


def _own_gpu_plane(data):
    """The trace's plane of this process's GPU, None if it has none. CUPTI may give a plane to
    every GPU the process sees (its peers' too, named by CUDA ordinal); this process's is the
    one holding its activity."""
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    # (a plane's events are iterable, not sized)
    return max(planes, key=lambda p: sum(1 for line in p.lines for _ in line.events),
               default=None)


def kernel_details(f, *a):
    """{kernel_name: CUPTI's launch details} of every kernel f runs on this process's first
    GPU: grid, block, registers a thread and shared memory a block, i.e. whether a kernel's
    blocks leave room beside another's on an SM (XLA's persistent GEMMs hold every SM)."""
    data = _profiled(f, *a)
    plane = None if data is None else _own_gpu_plane(data)
    found = {}
    for line in plane.lines if plane is not None else ():
        for e in line.events:
            details = dict(e.stats).get("kernel_details")
            if details:
                found.setdefault(kernel_name(e.name), details)
    return found


def gpu_events(f, *a, streams=False, host=None):
    """Runs f once (after a warm-up) under the JAX profiler and returns the GPU activity of
    this process's GPU as sorted (start ns, duration ns, name): every kernel, copy and
    memset, as CUPTI records it; `streams`: (start, duration, name, the trace's line, i.e.
    the stream it ran on). `host`: a regular expression; then also the host's events whose
    names match it (XLA's thunks, CUDA API calls), as (start, duration, name, "host " + the
    thread's line), in a second list. Nsight Systems cannot write reports on the device
    machines; this can."""
    data = _profiled(f, *a)
    if data is None:
        return []
    plane = _own_gpu_plane(data)
    gpu = [] if plane is None else sorted(
        (e.start_ns, e.duration_ns, e.name) + ((line.name,) if streams else ())
        for line in plane.lines for e in line.events)
    if host is None:
        return gpu
    wanted = re.compile(host)
    on_host = sorted((e.start_ns, e.duration_ns, e.name, f"host {line.name}")
                     for p in data.planes if p.name.startswith("/host")
                     for line in p.lines for e in line.events if wanted.search(e.name))
    return gpu, on_host


def is_ours(name):
    """Whether a GPU activity is one of jax_ep's kernels (their mangled names hold jax_ep)."""
    return "jax_ep" in name


def is_nccl(name):
    """Whether a GPU activity is an NCCL kernel (XLA's collectives)."""
    return "nccl" in name.lower()


def kernel_name(name):
    """A readable name for a GPU activity: a C++ kernel by its function's name, the last
    length-prefixed identifier of its mangled nested name (_ZN<len><id>...<len><id>E or I)."""
    i = name.find("_ZN")
    j, last = i + 3, None
    while i >= 0 and j < len(name) and name[j].isdigit():
        k = j
        while k < len(name) and name[k].isdigit():
            k += 1
        length = int(name[j:k])
        last, j = name[k:k + length], k + length
    return last or name[:40]


def call_profile(events, calls, marker=is_ours):
    """Per call of a chain of `calls` calls (the middle 80 %, to skip the program's start and
    end), medians in µs: the GPU's cycle (one call's first marked kernel to the next's), the
    time in the marked kernels (the operation's: jax_ep's, or NCCL's for XLA's collectives),
    in other GPU work (what the program runs between the calls) and idle; plus each activity's
    mean time per call. None if the trace holds no marked kernels in a multiple of `calls`."""
    ours = [i for i, e in enumerate(events) if marker(e[2])]
    if not ours or len(ours) % calls:
        return None
    starts = ours[::len(ours) // calls] + [len(events)]
    lo, hi = calls // 10, max(calls // 10 + 1, calls - calls // 10 - 1)
    cycle, mine, other, names, spans = [], [], [], {}, {}
    for c in range(lo, hi):
        window = events[starts[c]:starts[c + 1]]
        if starts[c + 1] == len(events):
            break
        cycle.append(events[starts[c + 1]][0] - events[starts[c]][0])
        mine.append(sum(d for _, d, n, *_ in window if marker(n)))
        other.append(sum(d for _, d, n, *_ in window if not marker(n)))
        for t0, d, n, *_ in window:
            names[kernel_name(n)] = names.get(kernel_name(n), 0) + d
            at = spans.setdefault(kernel_name(n), ([], []))  # its first start, last end
            if len(at[0]) < len(cycle):
                at[0].append(t0 - events[starts[c]][0])
                at[1].append(0)
            at[1][-1] = max(at[1][-1], t0 + d - events[starts[c]][0])
    if not cycle:
        return None
    k = len(cycle)
    med = lambda v: float(np.median(v)) / 1e3  # noqa: E731
    return {"calls": k, "cycle": med(cycle), "kernels": med(mine), "other": med(other),
            "idle": med(np.subtract(cycle, np.add(mine, other))),
            "per_name": {n: v / k / 1e3 for n, v in names.items()},
            "spans": {n: (med(a), med(b)) for n, (a, b) in spans.items()}}


def print_call_profiles(profiles):
    """Prints call_profile results: [(operation, profile)]."""
    if not profiles:
        return
    print("\nGPU time per call from a profiler (CUPTI) trace of the same chained program on "
          "this rank, medians over the middle calls (µs): cycle = the operation's kernels + "
          "other GPU work (the chain's own ops) + idle (kernels of one call may overlap: "
          "programmatic launch)")
    for name, p in profiles:
        if p is None:
            print(f"{name}: the operation's kernels not found in the trace")
            continue
        print(f"{name}: cycle {p['cycle']:.1f} = kernels {p['kernels']:.1f} + other "
              f"{p['other']:.1f} + idle {p['idle']:.1f}")
        print("    " + ", ".join(f"{n} {v:.1f}" for n, v in p["per_name"].items()))
        print("    from the call's first kernel, median first start-last end: " + ", ".join(
            f"{n} {a:.1f}-{b:.1f}" for n, (a, b) in sorted(p["spans"].items(),
                                                           key=lambda kv: kv[1][0])))


def print_phases(profiles):
    """Prints kernel_phases results: [(operation, phases)]."""
    print("\nKernel phases of one call on this rank, µs from the first kernel's start: entered "
          "(first block) / done waiting for peers (last block) / finished (first block, last "
          "block) / retired (last block past its closing fences and flags)")
    for name, phases in profiles:
        print(f"{name}:")
        for kernel, times in phases:
            print(f"    {kernel:24s} " + " / ".join(f"{v:7.1f}" for v in times))


def jax_baselines(R, H, in_rank, counts, x, shard, record, axis_name):
    """What a JAX user has today, on the same routing: ``jax.lax.ragged_all_to_all`` of the
    rank-deduplicated rows (one process only: XLA refuses it across processes), a
    ``jax.lax.all_to_all`` padded to the largest (source, destination) count, and a
    ``jax.lax.all_gather`` of x (the rows of the source_slots layout, without its metadata:
    with few ranks nearly every token is needed everywhere).

    in_rank: [R(src), T, R(dst)] whether a token goes to a rank; counts: [R(src), R(dst)];
    x: [R*T, H] sharded; record(name, body, *arrays, chained=0, marker=is_nccl) times body
    (marker: which GPU kernels are the operation's, for the profile).
    """
    S = int(counts.sum(1).max())
    Rv = int(counts.sum(0).max())
    C = int(counts.max())
    idx = np.zeros((R, S), np.int32)
    in_off = np.zeros((R, R), np.int32)
    out_off = np.zeros((R, R), np.int32)
    didx = np.zeros((R, R, C), np.int32)
    for r in range(R):
        order = np.concatenate([np.nonzero(in_rank[r, :, d])[0] for d in range(R)])
        idx[r, : len(order)] = order
        in_off[r] = np.concatenate([[0], np.cumsum(counts[r])[:-1]])
        for d in range(R):
            tok = np.nonzero(in_rank[r, :, d])[0]
            didx[r, d, : len(tok)] = tok
    for d in range(R):
        out_off[:, d] = np.concatenate([[0], np.cumsum(counts[:, d])[:-1]])
    flat = lambda a: put(a.reshape((R * a.shape[1], *a.shape[2:])), shard)  # noqa: E731

    def ragged(x, idx, in_off, sizes, out_off, recv_sizes):
        send = jnp.take(x, idx, axis=0)
        out = jnp.zeros((Rv, H), x.dtype)
        return jax.lax.ragged_all_to_all(send, out, in_off, sizes, out_off, recv_sizes,
                                         axis_name=axis_name)

    def padded(x, didx):
        send = jnp.take(x, didx.reshape(-1), axis=0).reshape(R, C, H)
        return jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)

    if jax.process_count() == 1:
        record("jax.lax.ragged_all_to_all", ragged, x, flat(idx), flat(in_off), flat(counts),
               flat(out_off), flat(np.ascontiguousarray(counts.T)), chained=0, marker=is_nccl)
    record("jax.lax.all_to_all (capacity-padded)", padded, x, flat(didx), chained=0,
           marker=is_nccl)

    def gathered(x):  # what the source_slots layout's rows are: every rank's x, in rank order
        return jax.lax.all_gather(x, axis_name, tiled=True)

    record("jax.lax.all_gather (source_slots' rows, no metadata)", gathered, x, chained=0,
           marker=is_nccl)
