"""jax_ep.Config: validation, the order explicit > environment override > measured default,
and what reaches the CUDA custom calls (lowered for CUDA on any machine)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import config as cfg

AXIS = "ep"
SHAPE = dict(num_ranks=2, num_topk=8, num_experts=256)


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for name in cfg.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dispatch_path="push"), "dispatch_path"),
    (dict(combine_path="fused"), "combine_path"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=2.0), "num_blocks"),
    (dict(num_blocks=True), "num_blocks"),
    (dict(copy_chunk_mb=0), "copy_chunk_mb"),
    (dict(copy_chunk_mb="8"), "copy_chunk_mb"),
    (dict(timeout_s=-1.0), "timeout_s"),
    (dict(stream=-1), "stream"),
    (dict(stream=1.0), "stream"),
    (dict(stream=True), "stream"),
])
def test_bad_fields_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax_ep.Config(**kwargs)


def test_configs_are_hashable_static_values():
    a, b = jax_ep.Config(dispatch_path="pull"), jax_ep.Config(dispatch_path="pull")
    assert a == b and hash(a) == hash(b) and a != jax_ep.Config()


def _full(dispatch_path, combine_path, num_blocks, copy_chunk_mb=16.0, timeout_s=100.0):
    return jax_ep.Config(dispatch_path, combine_path, num_blocks, copy_chunk_mb, timeout_s)


def test_defaults_follow_the_layout_and_the_path(monkeypatch):
    assert cfg.resolve(None, layout="rank_major", **SHAPE) == _full("fused", "push", 64)
    assert cfg.resolve(None, layout="expert_major", **SHAPE) == _full("fused", "pull", 64)
    slots = cfg.resolve(None, layout="source_slots", **SHAPE)
    assert slots.combine_path == "copy" and slots.num_blocks == 32  # its copy engines
    # expert_major's combine takes every SM (132 here), the copy-engine paths 32 / 22 / 19 CTAs
    monkeypatch.setattr(cfg, "_multiprocessors", lambda: 132)
    assert cfg.num_blocks(None, layout="expert_major", operation="combine") == 132
    assert cfg.num_blocks(None, layout="expert_major", operation="dispatch") == 64
    assert cfg.num_blocks(None, layout="rank_major", operation="combine") == 64
    assert [cfg.copy_engine_blocks(R) for R in (2, 4, 8)] == [32, 22, 19]
    assert cfg.num_blocks(None, layout="rank_major", path="copy", num_ranks=4) == 22
    assert cfg.resolve(jax_ep.Config(combine_path="copy"), layout="rank_major",
                       operation="combine", **SHAPE).num_blocks == 32
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")
    assert cfg.num_blocks(None, layout="expert_major", operation="combine") == 24
    # expert_major always pulls its combine
    assert cfg.combine_path(jax_ep.Config(combine_path="copy"), layout="expert_major",
                            **SHAPE) == "pull"


def test_source_slots_dispatches_by_copy_engines_unless_fused_is_asked_for(monkeypatch):
    slots = dict(SHAPE, layout="source_slots")
    assert cfg.dispatch_path(None, **slots) == "copy"
    assert cfg.resolve(None, **slots).num_blocks == 32  # the copy engines' CTAs
    fused = cfg.resolve(jax_ep.Config(dispatch_path="fused"), **slots)
    assert fused.dispatch_path == "fused" and fused.num_blocks == 64  # the SMs' default
    monkeypatch.setenv("JAX_EP_DISPATCH", "auto")
    assert cfg.dispatch_path(None, **slots) == "copy"


def test_the_push_combine_is_rank_major_only():
    push = jax_ep.Config(combine_path="push")
    assert cfg.combine_path(push, layout="rank_major", **SHAPE) == "push"
    assert cfg.combine_path(push, layout="expert_major", **SHAPE) == "pull"
    assert cfg.combine_path(push, layout="source_slots", **SHAPE) == "copy"  # its default


def test_the_default_combine_pulls_where_it_reads_peers_arrays_in_place(monkeypatch):
    monkeypatch.setattr(cfg, "_reads_in_place", lambda: True)
    assert cfg.resolve(None, layout="rank_major", **SHAPE) == _full("fused", "pull", 64)
    assert cfg.combine_path(jax_ep.Config(num_blocks=128), layout="rank_major",
                            **SHAPE) == "pull"
    assert cfg.combine_path(jax_ep.Config(combine_path="push"), layout="rank_major",
                            **SHAPE) == "push"  # asked for: it stands
    monkeypatch.setattr(cfg, "_reads_in_place", lambda: False)
    assert cfg.combine_path(None, layout="rank_major", **SHAPE) == "push"


def test_the_default_combine_pulls_below_the_push_combines_blocks(monkeypatch):
    few = jax_ep.Config(num_blocks=cfg.PUSH_COMBINE_MIN_BLOCKS - 1)
    assert cfg.combine_path(few, layout="rank_major", **SHAPE) == "pull"
    resolved = cfg.resolve(few, layout="rank_major", operation="combine", **SHAPE)
    assert resolved.combine_path == "pull"
    # an explicit push stands at any count; auto falls back to the default
    assert cfg.combine_path(jax_ep.Config(combine_path="push", num_blocks=8),
                            layout="rank_major", **SHAPE) == "push"
    monkeypatch.setenv("JAX_EP_COMBINE", "auto")
    assert cfg.combine_path(None, layout="rank_major", **SHAPE) == "copy"  # a peer needs ~all
    assert cfg.combine_path(None, layout="rank_major", num_ranks=8, num_topk=2,
                            num_experts=256) == "push"
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")
    monkeypatch.delenv("JAX_EP_COMBINE")
    assert cfg.combine_path(None, layout="rank_major", **SHAPE) == "pull"


def test_explicit_beats_override_beats_default(monkeypatch):
    monkeypatch.setenv("JAX_EP_DISPATCH", "pull")
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "8")
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "30")
    assert cfg.resolve(None, layout="rank_major", **SHAPE) == _full("pull", "pull", 24, 8, 30)
    explicit = jax_ep.Config(dispatch_path="copy", num_blocks=32, copy_chunk_mb=4, timeout_s=5)
    assert cfg.resolve(explicit, layout="rank_major", **SHAPE) == _full("copy", "pull", 32, 4, 5)
    monkeypatch.setenv("JAX_EP_DISPATCH", "auto")  # copy where a peer needs >= 85 % of tokens
    assert cfg.dispatch_path(None, layout="rank_major", **SHAPE) == "copy"
    assert cfg.dispatch_path(None, layout="expert_major", **SHAPE) == "fused"
    monkeypatch.setenv("JAX_EP_COMBINE", "bogus")
    with pytest.raises(ValueError, match="JAX_EP_COMBINE"):
        cfg.combine_path(None, layout="rank_major", **SHAPE)
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "-2")
    with pytest.raises(ValueError, match="copy_chunk_mb"):
        cfg.copy_chunk_mb(None)


def test_low_latency_calls_take_their_kernels_block_count(monkeypatch):
    assert cfg.resolve_low_latency(None).num_blocks is None  # one per SM, the kernels' own
    assert cfg.tuning_attributes(cfg.resolve_low_latency(None))["num_blocks"] == 0
    assert cfg.resolve_low_latency(jax_ep.Config(num_blocks=8, timeout_s=2)) == jax_ep.Config(
        num_blocks=8, copy_chunk_mb=16.0, timeout_s=2.0)
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "12")
    assert cfg.resolve_low_latency(None).num_blocks == 12


def test_split_low_latency_calls_take_few_ctas_by_default():
    """A split call's kernel runs beside the work after its send: it holds few SMs unless told."""
    assert cfg.resolve_low_latency(None, split="dispatch").num_blocks == 8
    assert cfg.resolve_low_latency(None, split="combine").num_blocks == 16
    # the dispatch's count is measured per device kind (Device.device_kind as JAX names it)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert cfg.resolve_low_latency(None, split="dispatch", device_kind=h100).num_blocks == 8
    assert cfg.resolve_low_latency(None, split="dispatch", device_kind=h200).num_blocks == 16
    assert cfg.resolve_low_latency(None, split="combine", device_kind=h200).num_blocks == 16
    assert cfg.resolve_low_latency(jax_ep.Config(num_blocks=12), split="dispatch",
                                   device_kind=h200).num_blocks == 12
    assert cfg.resolve_low_latency(None, device_kind=h200).num_blocks is None
    assert cfg.resolve_low_latency(jax_ep.Config(num_blocks=40), split="combine").num_blocks == 40
    assert cfg.tuning_attributes(cfg.resolve_low_latency(None, split="dispatch"))["num_blocks"] == 8
    with pytest.raises(ValueError, match="split"):
        cfg.resolve_low_latency(None, split=True)


def test_every_variable_is_read_in_the_config_module():
    """The environment jax_ep reads: at most 8 variables that change what it does, all read in
    jax_ep/config.py; the extension reads none."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    assert len(cfg.ENVIRONMENT) <= 8
    launcher = {"JAX_EP_RANK", "JAX_EP_WORLD_SIZE", "JAX_EP_LOCAL_RANK", "JAX_EP_LOCAL_DEVICE",
                "JAX_EP_COORDINATOR", "JAX_EP_SHARED_GPUS", "JAX_EP_LAUNCHER_PID"}
    for path in sorted((root / "jax_ep").glob("*.py")):
        if path.name == "config.py":
            continue
        for name in re.findall(r"JAX_EP_[A-Z0-9_]+", path.read_text()):
            assert name in launcher or name in cfg.ENVIRONMENT, (path.name, name)
            if name in cfg.ENVIRONMENT:  # mentioned elsewhere (docs, messages), read here
                assert not re.search(rf"environ(\.get)?\W+{name}", path.read_text()), name
    for path in sorted((root / "ffi").rglob("*")):
        if path.suffix in (".cc", ".cu", ".cuh", ".h"):
            assert "getenv(\"JAX_EP" not in path.read_text(), path.name


def test_config_must_be_a_config():
    def fn(x, idx):
        return jax_ep.dispatch(x, idx, num_experts=2, axis_name=AXIS, backend="reference",
                               config={"dispatch_path": "pull"}).x

    with pytest.raises(TypeError, match="jax_ep.Config"):
        _lower(fn)


def _lower(fn, layout_rows=4):
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS),
                              check_vma=False))
    x = jnp.zeros((2 * layout_rows, 128), jnp.bfloat16)
    idx = jnp.asarray(np.tile(np.array([0, 1], np.int32), (2 * layout_rows, 1)))
    return f.trace(x, idx).lower(lowering_platforms=("cuda",)).as_text()


def call_attributes(text, target):
    """{attribute: value} of each call of `target` in a lowered program, in program order:
    integers, floats, strings and booleans, the `tuning` dictionary's entries among them."""
    calls = []
    for line in text.splitlines():
        if f"custom_call @{target}(" not in line:
            continue
        attrs = {k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", line)}
        attrs.update({k: float(v) for k, v in re.findall(r"(\w+) = ([-+.\deE]+) : f64", line)})
        attrs.update(re.findall(r'(\w+) = "([^"]*)"', line))
        attrs.update({k: v == "true" for k, v in re.findall(r"(\w+) = (true|false)\b", line)})
        calls.append(attrs)
    return calls


_attrs = call_attributes


def test_the_config_reaches_the_custom_calls_and_the_handle_keeps_it():
    from jax_ep import _cuda

    tuning = jax_ep.Config(dispatch_path="pull", num_blocks=24)

    def fn(x, idx):
        out = _cuda.dispatch(x, None, idx, jnp.ones(idx.shape, jnp.float32), _dispatch_config(
            "rank_major", tuning))
        return (jax_ep.combine(out.x, out.handle)
                + jax_ep.combine(out.x, out.handle, config=jax_ep.Config(combine_path="copy")))

    text = _lower(fn)
    (dispatch,) = _attrs(text, "jax_ep_dispatch")
    assert dispatch["path"] == "pull" and dispatch["num_blocks"] == 24
    assert dispatch["layout"] == "rank_major" and dispatch["has_scales"] is False
    assert dispatch["copy_chunk_bytes"] == 16 << 20 and dispatch["timeout_s"] == 100.0
    first, second = _attrs(text, "jax_ep_combine")
    assert first["num_blocks"] == 24 and first["path"] == "pull"  # the dispatch's config
    # its own: the copy engines at their CTA default on 2 ranks
    assert second["num_blocks"] == cfg.copy_engine_blocks(2) == 32 and second["path"] == "copy"


def test_a_stream_puts_the_calls_and_their_backward_on_it():
    from jax_ep import api

    if not api.stream_calls_supported():
        pytest.skip(f"jax {jax.__version__} has no functional compute_on (Config.stream)")

    def lowered(tuning, backend="cuda"):
        def fn(x, idx):
            def loss(x):
                config = dataclasses.replace(_dispatch_config("rank_major", tuning),
                                             backend=backend)
                out = api._dispatch(config, x, None, idx, jnp.ones(idx.shape, jnp.float32))
                return jnp.sum(jax_ep.combine(out.x, out.handle).astype(jnp.float32))

            return jax.grad(loss)(x)

        return _lower(fn)

    # the dispatch, and in the backward the combine's (a cached dispatch) and the dispatch's
    # for the rows (a combine): each a call on stream 2, none inline. The calls are pure: the
    # forward combine (the gradient of a sum needs none of its values) and the combine of the
    # constant weights' gradient are dropped
    text = lowered(jax_ep.Config(stream=2))
    calls = [line for line in text.splitlines() if "func.call @compute_on" in line]
    assert len(calls) == 3
    assert all('_xla_stream_annotation = "2", inlineable = "false"' in c for c in calls)
    assert "_xla_stream_annotation" not in lowered(None)
    # the reference's collectives (all_to_all) cannot run in a stream-annotated call
    assert "_xla_stream_annotation" not in lowered(jax_ep.Config(stream=2), "reference")
    cfg.set_process_config(jax_ep.Config(stream=1))
    try:
        assert cfg.stream(None) == 1 and cfg.stream(jax_ep.Config(stream=0)) == 0
    finally:
        cfg.set_process_config(None)


def test_on_stream_puts_independent_work_on_a_stream():
    from jax_ep import api

    for bad in (0, -1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="stream number >= 1"):
            jax_ep.on_stream(jnp.sin, bad)
    with pytest.raises(TypeError, match="wraps a function"):
        jax_ep.on_stream(3)
    if not api.stream_calls_supported():
        with pytest.raises(NotImplementedError, match="jax >= 0.10"):
            jax_ep.on_stream(jnp.sin)
        pytest.skip(f"jax {jax.__version__} has no functional compute_on")

    def fn(x, idx):  # a combine on the program's stream, a matmul beside it on stream 3
        config = _dispatch_config("rank_major", None)
        out = api._dispatch(config, x, None, idx, jnp.ones(idx.shape, jnp.float32))
        y = jax_ep.combine(out.x, out.handle)
        work = jax_ep.on_stream(lambda a: jnp.dot(a, a.T) @ a, stream=3)(x)
        return y + work

    text = _lower(fn)
    calls = [line for line in text.splitlines() if "func.call @compute_on" in line]
    assert len(calls) == 1 and '_xla_stream_annotation = "3"' in calls[0]
    # jax_ep's own calls inside the work would share the workspace with those beside it

    def combine_inside(x, idx):
        out = jax_ep.dispatch(x, idx, num_experts=4, axis_name=AXIS)
        return jax_ep.on_stream(lambda y: jax_ep.combine(y, out.handle))(out.x)

    for body in (combine_inside,
                 lambda x, idx: jax_ep.on_stream(lambda x: jax_ep.dispatch(
                     x, idx, num_experts=4, axis_name=AXIS).x)(x),
                 lambda x, idx: jax_ep.on_stream(lambda x: jax_ep.low_latency_dispatch(
                     x, idx, num_experts=4, max_tokens_per_rank=8, axis_name=AXIS).x)(x)):
        with pytest.raises(ValueError, match="inside a jax_ep.on_stream function"):
            _lower(body)
    # the work's value: off the GPU, XLA runs the call inline
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(jax.jit(jax_ep.on_stream(lambda a: jnp.sin(a) @ a.T))(x),
                               jnp.sin(x) @ x.T, rtol=1e-6)


def test_on_stream_keeps_collectives_and_nested_calls_out_of_the_stream():
    """A weight the same on every device (a shared expert's) gets its gradient summed over the
    mesh: that all-reduce must not land inside the stream call (XLA aborts on it there); a
    jitted function inside (jax.nn.silu) must not be marked with the stream."""
    from jax_ep import api

    if not api.stream_calls_supported():
        pytest.skip(f"jax {jax.__version__} has no functional compute_on")
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))

    def shared(x, w, scale):  # jax.nn.silu is a jitted function: a nested call
        return jax.nn.silu(x @ w) * scale

    def grads(side):
        def loss(x, w):
            return jnp.sum(side(x, w, 0.5) ** 2)
        return jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                                     in_specs=(P(AXIS), P()), out_specs=(P(AXIS), P())))

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)) / 4, jnp.float32)
    f = grads(jax_ep.on_stream(shared))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    inside, where = False, {}
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            inside = "@compute_on" in line
        if "stablehlo.all_reduce" in line:
            where[inside] = where.get(inside, 0) + 1
    assert where == {False: 1}, where  # one sum, in the program's own function
    # only the stream calls (forward, backward) carry the stream: XLA would make a marked
    # nested call (silu's) an async call inside the first, which no stream reaches
    marked = [line for line in text.splitlines() if "_xla_stream_annotation" in line]
    assert len(marked) == 2 and all("call @compute_on" in line for line in marked), marked
    for got, want in zip(f(x, w), grads(shared)(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # inputs all the same on every device keep that type (their result may leave as P())
    replicated = jax.jit(jax.shard_map(jax_ep.on_stream(lambda w: 2 * w), mesh=mesh,
                                       in_specs=P(), out_specs=P()))
    np.testing.assert_allclose(replicated(w), 2 * w)


def test_environment_overrides_apply_when_no_config(monkeypatch):
    from jax_ep import _cuda

    monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "16")
    monkeypatch.setenv("JAX_EP_COPY_CHUNK_MB", "1.5")
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "7.5")

    def fn(x, idx):
        out = _cuda.dispatch(x, None, idx, jnp.ones(idx.shape, jnp.float32),
                             _dispatch_config("rank_major", None))
        return out.x

    (dispatch,) = _attrs(_lower(fn), "jax_ep_dispatch")
    assert dispatch["path"] == "copy" and dispatch["num_blocks"] == 16
    assert dispatch["copy_chunk_bytes"] == 3 << 19 and dispatch["timeout_s"] == 7.5


def _dispatch_config(layout, tuning):
    from jax_ep._types import DispatchConfig

    return DispatchConfig(num_experts=2, num_ranks=2, num_tokens=4, hidden=128, num_topk=2,
                          capacity=8, layout=layout, axis_name=AXIS, backend="cuda",
                          tuning=tuning)


def test_the_process_config_fills_what_a_call_leaves_unset(monkeypatch):
    monkeypatch.setenv("JAX_EP_DISPATCH", "pull")
    cfg.set_process_config(jax_ep.Config(dispatch_path="copy", num_blocks=12))
    try:
        assert cfg.resolve(None, layout="rank_major", **SHAPE) == _full("copy", "pull", 12)
        mine = jax_ep.Config(dispatch_path="fused")
        assert cfg.resolve(mine, layout="rank_major", **SHAPE) == _full("fused", "pull", 12)
        with pytest.raises(TypeError, match="jax_ep.Config"):
            cfg.set_process_config("fused")
    finally:
        cfg.set_process_config(None)
    assert cfg.dispatch_path(None, layout="rank_major", **SHAPE) == "pull"  # the override again


def test_runtime_variables_are_read_in_the_config_module(monkeypatch):
    from jax_ep import runtime

    monkeypatch.setenv("JAX_EP_BUFFER_BYTES", "2e9")
    monkeypatch.setenv("JAX_EP_LL_BUFFER_BYTES", "4096")
    assert runtime.default_buffer_bytes() == 2_000_000_000
    assert runtime.default_low_latency_bytes() == 4096
    monkeypatch.delenv("JAX_EP_BUFFER_BYTES")
    assert runtime.default_buffer_bytes() == runtime.DEFAULT_BUFFER_BYTES
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="JAX_EP_TIMEOUT_S must be a number"):
        cfg.timeout_s(None)
    monkeypatch.setenv("JAX_EP_COMMAND_BUFFERS", "1")
    assert cfg.command_buffers()


def test_only_local_targets_are_command_buffer_compatible_by_default(monkeypatch):
    from jax_ep import _native

    monkeypatch.delenv("JAX_EP_COMMAND_BUFFERS", raising=False)
    assert _native.command_buffer_traits("jax_ep_layout")["traits"]
    assert _native.command_buffer_traits("jax_ep_quantize_fp8")["traits"]
    assert _native.command_buffer_traits("jax_ep_grouped_matmul")["traits"]
    # calls that wait for peers or number calls on the device stay out of XLA's graphs
    for name in ("jax_ep_dispatch", "jax_ep_combine", "jax_ep_ll_dispatch_send",
                 "jax_ep_ll_combine", "jax_ep_batched_matmul"):
        assert _native.command_buffer_traits(name) == {}
    monkeypatch.setenv("JAX_EP_COMMAND_BUFFERS", "1")
    assert _native.command_buffer_traits("jax_ep_dispatch")["traits"]


def test_the_default_dispatch_is_fused_at_any_cta_count(monkeypatch):
    # in place that is the lean push, which wins at 24 CTAs as at 64 (benchmarks/RESULTS.md)
    for in_place in (True, False):
        monkeypatch.setattr(cfg, "_reads_in_place", lambda in_place=in_place: in_place)
        for blocks in (8, 24, 64, 132):
            config = jax_ep.Config(num_blocks=blocks)
            for layout in ("rank_major", "expert_major"):
                assert cfg.dispatch_path(config, layout=layout, **SHAPE) == "fused"
            assert cfg.resolve(config, layout="rank_major", **SHAPE).dispatch_path == "fused"
        monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")
        assert cfg.dispatch_path(None, layout="rank_major", **SHAPE) == "fused"
        monkeypatch.delenv("JAX_EP_NUM_BLOCKS")
    # an explicit path and the variable stand
    assert cfg.dispatch_path(jax_ep.Config(dispatch_path="pull", num_blocks=24),
                             layout="rank_major", **SHAPE) == "pull"
    monkeypatch.setenv("JAX_EP_DISPATCH", "pull")
    assert cfg.dispatch_path(None, layout="rank_major", **SHAPE) == "pull"

def test_source_slots_moves_its_rows_by_the_sms_where_they_land_in_place(monkeypatch):
    monkeypatch.setattr(cfg, "_reads_in_place", lambda: True)
    assert cfg.resolve(None, layout="source_slots", **SHAPE) == _full("fused", "pull", 64)
    combine = cfg.resolve(None, layout="source_slots", operation="combine", **SHAPE)
    assert combine == _full("fused", "pull", 64)
    # the copy engines where asked for, with their own CTA count
    copy = cfg.resolve(jax_ep.Config(dispatch_path="copy"), layout="source_slots", **SHAPE)
    assert copy.num_blocks == cfg.copy_engine_blocks(2)
    monkeypatch.setattr(cfg, "_reads_in_place", lambda: False)
    slots = cfg.resolve(None, layout="source_slots", **SHAPE)
    assert slots == _full("copy", "copy", cfg.copy_engine_blocks(2))


def test_mesh_axes_inside_and_outside_shard_map():
    """The varying-axes helpers that the stream calls and the CUDA backend type values with."""
    from jax_ep import _mesh

    if getattr(jax, "typeof", None) is None:
        pytest.skip(f"jax {jax.__version__} has no varying-axes types")
    x = jnp.ones((4, 2))
    assert _mesh.varying_axes(x) == ()
    assert _mesh.as_varying(x, ()) is x
    seen = {}

    def body(a, b):
        seen.update(a=_mesh.varying_axes(a),
                    b=_mesh.varying_axes(b),
                    cast=_mesh.varying_axes(_mesh.as_varying(b, {AXIS})),
                    again=_mesh.varying_axes(_mesh.as_varying(a, {AXIS})),
                    alike=tuple(_mesh.varying_axes(v) for v in _mesh.vary_alike(a, b)))
        return a + b

    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS))).trace(
        jnp.ones((4, 2)), jnp.ones((2,)))
    if seen["a"] == ():
        pytest.skip(f"jax {jax.__version__} types no varying axes inside shard_map")
    assert seen == dict(a=(AXIS,), b=(), cast=(AXIS,), again=(AXIS,),
                        alike=((AXIS,), (AXIS,))), seen


def test_split_gemm_sms_leave_the_split_call_its_ctas(monkeypatch):
    """The SM count for a GEMM between a split send and its receive: the GPU's SMs less the
    split call's CTAs (its config's, else the default for the GPU's kind); None off the GPU."""
    from jax_ep import _cuda

    monkeypatch.delenv("JAX_EP_NUM_BLOCKS", raising=False)
    monkeypatch.setattr(cfg, "_multiprocessors", lambda: None)
    assert jax_ep.low_latency_split_gemm_sms() is None
    monkeypatch.setattr(cfg, "_multiprocessors", lambda: 132)
    monkeypatch.setattr(_cuda, "_gpu_kind", lambda: "NVIDIA H200")
    assert jax_ep.low_latency_split_gemm_sms("dispatch") == 116
    assert jax_ep.low_latency_split_gemm_sms("combine") == 116
    assert jax_ep.low_latency_split_gemm_sms(config=jax_ep.Config(num_blocks=20)) == 112
    monkeypatch.setattr(_cuda, "_gpu_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert jax_ep.low_latency_split_gemm_sms("dispatch") == 124
    assert jax_ep.low_latency_split_gemm_sms("combine") == 116
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")  # what the calls themselves would take
    assert jax_ep.low_latency_split_gemm_sms("dispatch") == 108
    with pytest.raises(ValueError, match="'dispatch' or 'combine'"):
        jax_ep.low_latency_split_gemm_sms("layout")
