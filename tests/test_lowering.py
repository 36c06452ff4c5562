"""What the CUDA backend hands to XLA, checked on any machine by lowering for CUDA.

XLA:GPU's dynamic-slice fusion copies a custom call whose operand is a slice (or whose result
feeds a dynamic-update-slice) into a fusion and keeps the side-effecting original, so the
kernels ran twice (seen on jax 0.11.2; the GPU suite counts executions). Our defence is that
every operand and every result of a jax_ep custom call passes through an optimization
barrier; this test keeps it there.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_ep import _cuda, reference
from jax_ep._types import LowLatencyConfig

AXIS = "ep"


def _lowered_for_cuda(fn, *args):
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(P(AXIS) for _ in args),
                              out_specs=P(AXIS), check_vma=False))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _values(text):
    """{SSA name: the op that defines it} and [(custom call target, operands, result)]."""
    defined, calls = {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = (\"?[\w.]+\"?)", line)
        if not m:
            continue
        name, op = m.groups()
        defined[name] = op.strip('"')
        call = re.search(r"stablehlo\.custom_call @(jax_ep_\w+)\(([^)]*)\)", line)
        if call:  # ours only: jax 0.6 also lowers shard_map to Sharding/SPMD* custom calls
            operands = [o.strip().split("#")[0] for o in call.group(2).split(",") if o.strip()]
            calls.append((call.group(1), operands, name))
    return defined, calls


def test_every_custom_call_is_fenced_by_optimization_barriers():
    config = LowLatencyConfig(num_experts=8, num_ranks=2, num_tokens=8, hidden=128, num_topk=2,
                              max_tokens_per_rank=8, use_fp8=True, axis_name=AXIS,
                              backend="cuda")

    def per_device(xs, idxs):
        x, idx = xs[0, 1], idxs[0, 1]  # slices of stacked inputs: what the fusion matches
        sent = _cuda.low_latency_send(x, idx, config)
        out = _cuda.low_latency_receive(sent, config)
        layout = _cuda.layout(idx, num_experts=8, num_ranks=2)
        stacked = jnp.zeros((3,) + out.x_scales.shape, jnp.float32).at[1].set(out.x_scales)
        return stacked[None], layout.num_tokens_per_rank[None]

    xs = jnp.zeros((2, 3, 8, 128), jnp.bfloat16)
    idxs = jnp.asarray(np.tile(np.arange(2, dtype=np.int32), (2, 3, 8, 1)))
    text = _lowered_for_cuda(per_device, xs, idxs)
    defined, calls = _values(text)
    assert {c[0] for c in calls} == {"jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_receive",
                                     "jax_ep_layout"}
    for target, operands, result in calls:
        for operand in operands:
            assert defined.get(operand) == "stablehlo.optimization_barrier", (target, operand)
        users = [line for line in text.splitlines()
                 if re.search(re.escape(result) + r"[#\s,)]", line.split("=", 1)[-1])]
        assert users and all("optimization_barrier" in line for line in users), (target, users)


@pytest.mark.parametrize("layout", ["expert_major", "records"])
def test_low_latency_packed_layouts_lower_packed_rows(layout):
    """layout="expert_major": the dispatch's rows, scales and handle rows are R*M*min(K, L)
    packed rows (the handlers read the layout from x's rank), the combine takes y so;
    "records": x and its scales are R*M rows (the `records` attribute says so), the handle's
    rows and y packed."""
    config = LowLatencyConfig(num_experts=8, num_ranks=2, num_tokens=8, hidden=256, num_topk=3,
                              max_tokens_per_rank=8, use_fp8=True, axis_name=AXIS,
                              backend="cuda", layout=layout)

    def per_device(x, idx):
        out = _cuda.low_latency_dispatch(x, idx, config)
        y = jnp.zeros(config.rows_shape + (256,), jnp.bfloat16)
        return _cuda.low_latency_combine(y, jnp.ones(idx.shape), out.handle)[None]

    x = jnp.zeros((16, 256), jnp.bfloat16)
    idx = jnp.asarray(np.tile(np.arange(3, dtype=np.int32), (16, 1)))
    text = _lowered_for_cuda(per_device, x, idx)
    P = 2 * 8 * 3  # R * M * min(K, L = 4)
    dispatch = [line for line in text.splitlines() if "@jax_ep_ll_dispatch(" in line]
    combine = [line for line in text.splitlines() if "@jax_ep_ll_combine(" in line]
    assert len(dispatch) == 1 and len(combine) == 1
    X = 2 * 8 if layout == "records" else P
    for shape in (f"tensor<{X}x256xf8E4M3FN>", f"tensor<{X}x2xf32>", f"tensor<{P}xi32>"):
        assert shape in dispatch[0], (shape, dispatch[0])
    assert f"records = {str(layout == 'records').lower()}" in dispatch[0], dispatch[0]
    assert f"tensor<{P}x256xbf16>" in combine[0]


def test_no_custom_call_declares_side_effects():
    """Every call is a function of its operands (XLA may merge, hoist or drop it alike on every
    rank) and a program without effects keeps jax's fast dispatch path. A split receive reads
    every result and operand of its send, so the halves are merged or dropped together."""
    import jax_ep
    from jax_ep import api
    from jax_ep._types import DispatchConfig

    config = LowLatencyConfig(num_experts=8, num_ranks=2, num_tokens=8, hidden=128, num_topk=2,
                              max_tokens_per_rank=8, use_fp8=True, axis_name=AXIS,
                              backend="cuda")
    normal = DispatchConfig(num_experts=8, num_ranks=2, num_tokens=8, hidden=128, num_topk=2,
                            capacity=16, layout="rank_major", axis_name=AXIS, backend="cuda")

    def per_device(x, idx):
        out = _cuda.low_latency_receive(_cuda.low_latency_send(x, idx, config), config)
        fused = _cuda.low_latency_dispatch(x, idx, config)
        moved = api._dispatch(normal, x, None, idx, jnp.ones(idx.shape, jnp.float32))
        back = jax_ep.combine(moved.x, moved.handle)
        layout = _cuda.layout(idx, num_experts=8, num_ranks=2)
        scales = _cuda.quantize_fp8(x, ue8m0=False)[1]
        return (out.x_scales[0, 0, 0] + fused.x_scales[0, 0, 0] + back[0, 0]
                + layout.num_tokens_per_rank[0] + scales[0, 0])[None]

    x = jnp.zeros((16, 128), jnp.bfloat16)
    idx = jnp.asarray(np.tile(np.arange(2, dtype=np.int32), (16, 1)))
    seen = {}
    for line in _lowered_for_cuda(per_device, x, idx).splitlines():
        call = re.search(r"stablehlo\.custom_call @(jax_ep_\w+)\(", line)
        if call:
            seen[call.group(1)] = "has_side_effect = true" in line
    assert set(seen) >= {"jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_receive",
                         "jax_ep_ll_dispatch", "jax_ep_dispatch", "jax_ep_combine",
                         "jax_ep_layout", "jax_ep_quantize_fp8"}, seen
    assert not any(seen.values()), seen


def test_reference_low_latency_combine_keeps_the_partials_rounding():
    """The reference rounds each rank's partial sum to y's dtype and back to float32; XLA:GPU
    (default xla_allow_excess_precision) folds that pair of converts away, which made the
    reference disagree with the CUDA kernels on GPU while agreeing on CPU. An optimization
    barrier between the two converts keeps the rounding."""
    from jax_ep import reference
    from jax_ep._types import LowLatencyHandle

    R, T, K, H, E, M = 2, 4, 2, 128, 8, 4
    config = LowLatencyConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=H, num_topk=K,
                              max_tokens_per_rank=M, use_fp8=False, axis_name=AXIS,
                              backend="reference")
    L = E // R

    def per_device(terms, idx, slot, src):
        handle = LowLatencyHandle(idx[0], slot[0], src[0], src[0], src[0],
                                  jnp.zeros((L,), jnp.int32), jnp.zeros((L, R), jnp.int32),
                                  config)
        sent = dict(terms=terms[0], dtype=jnp.zeros((0,), jnp.bfloat16))
        return reference.low_latency_combine_receive(sent, handle)[None]

    terms = jnp.ones((2, R, T, K, H), jnp.float32)
    idx = jnp.zeros((2, T, K), jnp.int32)
    slot = jnp.zeros((2, T, K), jnp.int32)
    src = jnp.zeros((2, L, R * M), jnp.int32)
    text = _lowered_for_cuda(per_device, terms, idx, slot, src)
    fenced = set()
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = stablehlo\.optimization_barrier .*bf16>\s*$",
                     line)
        if m:
            fenced.add(m.group(1))
    widened = [line for line in text.splitlines() if "stablehlo.convert" in line
               and any(re.search(re.escape(v) + r"[#\s,)]", line) for v in fenced)
               and "-> tensor<" in line and "xf32>" in line.split("->")[-1]]
    assert len(widened) == R, text  # one fenced rounding per rank's partial


def _fenced_roundings(text, dtype="bf16"):
    """Converts to float32 of values that an optimization barrier produced in `dtype`."""
    fenced = set()
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = stablehlo\.optimization_barrier .*" + dtype +
                     r">\s*$", line)
        if m:
            fenced.add(m.group(1))
    return [line for line in text.splitlines() if "stablehlo.convert" in line
            and any(re.search(re.escape(v) + r"[#\s,)]", line) for v in fenced)
            and "-> tensor<" in line and "xf32>" in line.split("->")[-1]]


def test_reference_expert_major_combine_keeps_the_partials_rounding():
    """expert_major's combine rounds each rank's partial sum to y's dtype (the contract); the
    reference fences that rounding like the low-latency one's, or XLA:GPU folds it away."""
    import jax_ep

    def per_device(x, idx):
        out = jax_ep.dispatch(x, idx, num_experts=4, axis_name=AXIS, layout="expert_major",
                              backend="reference")
        return jax_ep.combine(out.x, out.handle)

    x = jnp.ones((2 * 4, 128), jnp.bfloat16)
    idx = jnp.asarray(np.tile(np.array([0, 3], np.int32), (2 * 4, 1)))
    text = _lowered_for_cuda(per_device, x, idx)
    assert _fenced_roundings(text), text


def test_expected_token_share_matches_sampling():
    rng = np.random.default_rng(0)
    for R, K, E in [(2, 8, 256), (4, 8, 256), (8, 8, 256), (4, 2, 8)]:
        picks = np.argsort(rng.random((20000, E)), axis=1)[:, :K]  # K distinct experts
        sampled = np.mean((picks // (E // R) == 1).any(axis=1))    # the peer: rank 1
        assert abs(_cuda.expected_token_share(R, K, E) - sampled) < 0.01, (R, K, E)


def test_auto_picks_the_copy_engine_paths_for_few_ranks(monkeypatch):
    """JAX_EP_DISPATCH / JAX_EP_COMBINE=auto: copy for rank_major where a peer needs >= 85 %
    of the tokens (2 and 4 ranks, top-8 of 256), fused / pull otherwise."""
    monkeypatch.setenv("JAX_EP_DISPATCH", "auto")
    monkeypatch.setenv("JAX_EP_COMBINE", "auto")
    for R, want in [(2, True), (4, True), (8, False)]:
        rank_major = _cuda._resolve(None, R, 8, 256, "rank_major")
        assert (rank_major.dispatch_path == "copy") is want
        assert (rank_major.combine_path == "copy") is want
        expert_major = _cuda._resolve(None, R, 8, 256, "expert_major")
        assert (expert_major.dispatch_path, expert_major.combine_path) == ("fused", "pull")


def _lowered_dispatch_combine(layout):
    """The CUDA lowering of a dispatch followed by a combine (2 ranks, 8 tokens each), as the
    environment's data-path variables stand now."""
    from jax_ep._types import DispatchConfig

    config = DispatchConfig(num_experts=4, num_ranks=2, num_tokens=8, hidden=128, num_topk=2,
                            capacity=16, layout=layout, axis_name=AXIS, backend="cuda")

    def per_device(x, idx, w):
        out = _cuda.dispatch(x, None, idx, w, config)
        return _cuda.combine(out.x, None, out.handle)

    x = jnp.ones((2 * 8, 128), jnp.bfloat16)
    idx = jnp.zeros((2 * 8, 2), jnp.int32).at[:, 1].set(3)
    w = jnp.ones((2 * 8, 2), jnp.float32)
    return _lowered_for_cuda(per_device, x, idx, w)


def _calls(text, target):
    from test_config import call_attributes

    return call_attributes(text, target)


def test_combine_lowering_carries_its_path(monkeypatch):
    for mode in ("pull", "copy"):
        monkeypatch.setenv("JAX_EP_COMBINE", mode)
        monkeypatch.setenv("JAX_EP_DISPATCH", "fused" if mode == "pull" else "copy")
        text = _lowered_dispatch_combine("rank_major")
        ((dispatch,), (combine,)) = _calls(text, "jax_ep_dispatch"), _calls(text, "jax_ep_combine")
        assert combine["path"] == mode and combine["layout"] == "rank_major", mode
        assert dispatch["path"] == ("fused" if mode == "pull" else "copy"), mode


def test_dispatch_lowering_carries_the_data_path(monkeypatch):
    """JAX_EP_DISPATCH -> the dispatch's `path` attribute, the names the handler accepts."""
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    for mode in ("pull", "fused", "copy"):
        monkeypatch.setenv("JAX_EP_DISPATCH", mode)
        (dispatch,) = _calls(_lowered_dispatch_combine("rank_major"), "jax_ep_dispatch")
        assert dispatch["path"] == mode


def test_source_slots_selects_the_copy_engines(monkeypatch):
    """source_slots: the dispatch always takes the copy path, the combine defaults to copy and
    JAX_EP_COMBINE=pull still picks pull."""
    monkeypatch.delenv("JAX_EP_DISPATCH", raising=False)
    for mode, combine_path in [(None, "copy"), ("pull", "pull"), ("copy", "copy")]:
        if mode is None:
            monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
        else:
            monkeypatch.setenv("JAX_EP_COMBINE", mode)
        text = _lowered_dispatch_combine("source_slots")
        ((dispatch,), (combine,)) = _calls(text, "jax_ep_dispatch"), _calls(text, "jax_ep_combine")
        assert dispatch["layout"] == combine["layout"] == "source_slots", mode
        assert dispatch["path"] == "copy" and combine["path"] == combine_path, mode


def test_cuda_layout_results_vary_like_the_reference():
    """get_dispatch_layout's results differ between devices: the CUDA call marks them varying
    over topk_idx's axes as the reference does, so out_specs=P() is refused by both."""
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    idx = jnp.zeros((8, 2), jnp.int32)
    for module in (reference, _cuda):
        def f(i, module=module):
            return module.layout(i, num_experts=4, num_ranks=2).num_tokens_per_rank

        with pytest.raises(ValueError, match="require replication"):
            jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P()))(idx)


def _expert_major_call(op, num_topk, monkeypatch, dispatch_mode="fused"):
    """Lowers an expert_major dispatch (and a combine, for op="combine") with num_topk slots."""
    from jax_ep._types import DispatchConfig

    monkeypatch.setenv("JAX_EP_DISPATCH", dispatch_mode)
    monkeypatch.delenv("JAX_EP_COMBINE", raising=False)
    E, T = 2 * num_topk, 4
    config = DispatchConfig(num_experts=E, num_ranks=2, num_tokens=T, hidden=128,
                            num_topk=num_topk, capacity=2 * T * num_topk, layout="expert_major",
                            axis_name=AXIS, backend="cuda")

    def per_device(x, idx, w):
        out = _cuda.dispatch(x, None, idx, w, config)
        return _cuda.combine(out.x, None, out.handle) if op == "combine" else out.x

    x = jnp.ones((2 * T, 128), jnp.bfloat16)
    idx = jnp.tile(jnp.arange(num_topk, dtype=jnp.int32), (2 * T, 1))
    return _lowered_for_cuda(per_device, x, idx, jnp.ones((2 * T, num_topk), jnp.float32))


def test_cuda_limits_are_checked_at_trace_time(monkeypatch):
    """What the kernels cannot take is refused while tracing, with the limit and the way out,
    not by the handler at run time: fused dispatches and every combine keep a token's
    destinations in registers (at most max_sources), the low-latency kernels top-k <= 32."""
    limits = _cuda._limits()
    big = limits["max_sources"] + 1
    assert "jax_ep_dispatch" in _expert_major_call("dispatch", limits["max_sources"], monkeypatch)
    with pytest.raises(ValueError, match=rf"fused dispatch .*at most {big - 1} .*top-k {big}"):
        _expert_major_call("dispatch", big, monkeypatch)
    # pull has no such limit; the combine has
    assert "jax_ep_dispatch" in _expert_major_call("dispatch", big, monkeypatch, "pull")
    with pytest.raises(ValueError, match=rf"combine: the CUDA combine .*at most {big - 1}"):
        _expert_major_call("combine", big, monkeypatch, "pull")

    K = limits["low_latency_max_topk"] + 1
    config = LowLatencyConfig(num_experts=2 * K, num_ranks=2, num_tokens=4, hidden=128,
                              num_topk=K, max_tokens_per_rank=4, use_fp8=False, axis_name=AXIS,
                              backend="cuda")
    with pytest.raises(ValueError, match=rf"top-k <= {K - 1}, got {K}"):
        _lowered_for_cuda(lambda x, i: _cuda.low_latency_dispatch(x, i, config).x[None],
                          jnp.ones((8, 128), jnp.bfloat16),
                          jnp.zeros((8, K), jnp.int32))


def test_copy_engine_rank_limit_is_checked_at_trace_time(monkeypatch):
    limit = _cuda._limits()["max_copy_ranks"]
    monkeypatch.setattr(_cuda, "_limits", lambda: dict(max_copy_ranks=1, max_sources=16,
                                                       low_latency_max_topk=32))
    with pytest.raises(ValueError, match="source_slots layout.*at most 1 ranks"):
        _lowered_dispatch_combine("source_slots")
    monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
    with pytest.raises(ValueError, match="dispatch_path 'copy'.*at most 1 ranks"):
        _lowered_dispatch_combine("rank_major")
    assert limit == _cuda._MAX_COPY_RANKS  # the auto selection's copy of the limit


@pytest.mark.parametrize("names,shape,stride", [(("data", "expert"), (2, 4), 1),
                                                (("expert", "data"), (4, 2), 2),
                                                (("expert",), (8,), 1)])
def test_calls_carry_their_ep_group(names, shape, stride):
    """EP on one axis of a multi-axis mesh: every call names the axis's size and its stride in
    the mesh's row-major order, from which the extension finds the group's PEs."""
    from jax_ep._types import DispatchConfig

    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    R = shape[names.index("expert")]
    E, T, K = 2 * R, 4, 2
    config = DispatchConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=128, num_topk=K,
                            capacity=R * T * K, axis_name="expert", backend="cuda")
    ll = LowLatencyConfig(num_experts=E, num_ranks=R, num_tokens=T, hidden=128, num_topk=K,
                          max_tokens_per_rank=T, use_fp8=False, axis_name="expert",
                          backend="cuda")

    def fn(x, idx):
        out = _cuda.dispatch(x, None, idx, jnp.ones(idx.shape, jnp.float32), config)
        back = _cuda.combine(out.x, None, out.handle)
        low = _cuda.low_latency_dispatch(x, idx, ll)
        return back + _cuda.low_latency_combine(low.x, jnp.ones(idx.shape), low.handle)

    spec = P(names)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                              check_vma=False))
    x = jnp.zeros((8 * T, 128), jnp.bfloat16)
    idx = jnp.zeros((8 * T, K), jnp.int32)
    text = f.trace(x, idx).lower(lowering_platforms=("cuda",)).as_text()
    groups = re.findall(r"group = \{num_ranks = (\d+) : i64, stride = (\d+) : i64\}", text)
    assert len(groups) == text.count("custom_call @jax_ep_") - text.count("@jax_ep_layout")
    assert set(groups) == {(str(shape[names.index("expert")]), str(stride))}


@pytest.mark.parametrize("names", [("data", "expert"), ("expert", "data")])
def test_cuda_results_vary_over_every_axis_of_their_operands(names, monkeypatch):
    """On a two-axis mesh the CUDA calls' results vary over the data axis too (each EP group
    has its own), so the custom VJPs' types match their primals' under shard_map's checks."""
    from jax_ep import _native, api, moe

    monkeypatch.setattr(api, "cuda_available", lambda: (True, ""))
    monkeypatch.setattr(_native, "register", lambda *a, **k: None)
    shape = (2, 4) if names[0] == "data" else (4, 2)
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    T, H, F, E = 8, 16, 8, 8

    def per_device(x, router, w_in, w_out):
        def loss(x, router, w_in, w_out):
            out, dropped = moe.moe_block(x, router, w_in, w_out, top_k=2, axis_name="expert",
                                         backend="cuda")
            return jnp.sum(jnp.sin(out)), jax.lax.psum(dropped, names)

        grads, dropped = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            x[0], router[0], w_in[0], w_out[0])
        return jax.tree.map(lambda a: a[None], grads), dropped

    spec = P(names)
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4,
                              out_specs=(spec, P())))
    f.trace(jnp.zeros((8, T, H)), jnp.zeros((8, H, E)), jnp.zeros((8, 2, H, F)),
            jnp.zeros((8, 2, F, H)))


def test_quantize_fp8_takes_the_kernel_inside_shard_map_only(monkeypatch):
    """backend="auto" quantises with the CUDA kernel inside shard_map over every mesh axis;
    outside it a custom call would be replicated by XLA's partitioner, so XLA's ops run."""
    import jax_ep
    from jax_ep import api

    # as in a GPU process, lowering a program of its GPUs (here traced on host devices)
    monkeypatch.setattr(api, "cuda_available", lambda: (True, ""))
    monkeypatch.setattr(api, "traced_platform", lambda: "gpu")
    x = jnp.zeros((8, 256), jnp.bfloat16)
    inside = _lowered_for_cuda(lambda x: jax_ep.quantize_fp8(x)[1], x)
    assert "@jax_ep_quantize_fp8" in inside
    # vmapped: one call over the batch, its operand [batch, rows, hidden]
    batched = _lowered_for_cuda(
        lambda x: jax.vmap(jax_ep.quantize_fp8)(jnp.stack([x, x]))[1][0], x)
    (call,) = [ln for ln in batched.splitlines() if "@jax_ep_quantize_fp8" in ln]
    assert "tensor<2x4x256xbf16>" in call, call  # 4 rows a device
    outside = jax.jit(lambda x: jax_ep.quantize_fp8(x)[1]).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jax_ep_quantize_fp8" not in outside
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        jax_ep.quantize_fp8(jnp.zeros((8, 256), jnp.int32))


def test_dispatch_use_fp8_quantises_in_the_dispatch_call():
    """use_fp8 on the CUDA backend: one jax_ep_dispatch that takes the unquantised rows
    (quantize = true, e4m3 rows out), no separate quantize call."""
    from jax_ep import api
    from jax_ep._types import DispatchConfig

    normal = DispatchConfig(num_experts=8, num_ranks=2, num_tokens=8, hidden=256, num_topk=2,
                            capacity=16, layout="rank_major", axis_name=AXIS, backend="cuda",
                            use_fp8=True)

    def per_device(x, idx):
        out = api._dispatch(normal, x, None, idx, jnp.ones(idx.shape, jnp.float32))
        return out.x_scales[:1, 0]

    x = jnp.zeros((16, 256), jnp.bfloat16)
    idx = jnp.asarray(np.tile(np.arange(2, dtype=np.int32), (16, 1)))
    text = _lowered_for_cuda(per_device, x, idx)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @jax_ep_" in line]
    assert len(calls) == 1 and "@jax_ep_dispatch(" in calls[0], calls
    assert "quantize = true" in calls[0] and "f8E4M3FN" in calls[0], calls[0]


def test_decode_layer_lowers_to_the_low_latency_calls_and_grouped_gemms(monkeypatch):
    """moe.decode_layer on the CUDA backend: one records dispatch, the SwiGLU's three grouped
    GEMMs (the first two reading the records by the handle's index), one combine."""
    from jax_ep import api, experts, moe

    monkeypatch.setattr(api, "cuda_available", lambda: (True, ""))
    monkeypatch.setattr(experts, "_native_gemm_available", lambda: True)
    R, T, H, F, E, K = 2, 8, 256, 128, 8, 2
    params = moe.MoEParams(jnp.zeros((H, E)), *(jnp.zeros(s, jnp.bfloat16)
                                                for s in ((E, H, F), (E, H, F), (E, F, H))))
    mesh = jax.make_mesh((R,), (AXIS,), devices=jax.devices()[:R],
                         axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(
        lambda x, p: moe.decode_layer(x, p, top_k=K, axis_name=AXIS, backend="cuda")[0],
        mesh=mesh, in_specs=(P(AXIS), params.partition_specs(AXIS)), out_specs=P(AXIS),
        check_vma=False))
    text = f.trace(jnp.zeros((R * T, H), jnp.bfloat16), params).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_ep_" in ln]
    targets = [re.search(r"@(jax_ep_\w+)", ln).group(1) for ln in calls]
    assert targets == ["jax_ep_ll_dispatch"] + ["jax_ep_grouped_matmul"] * 3 + \
        ["jax_ep_ll_combine"], targets
    assert "records = true" in calls[0]
    P_rows = R * T * min(K, E // R)
    gathered = [f"tensor<{P_rows}xi32>" in ln.split("->")[0] for ln in calls[1:4]]
    assert gathered == [True, True, False], calls[1:4]
