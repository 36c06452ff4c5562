"""jax_ep.Config: validation, the order explicit > environment override > measured default,
and what reaches the CUDA custom calls (lowered for CUDA on any machine)."""

from __future__ import annotations

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
    for name in ("JAX_EP_DISPATCH", "JAX_EP_COMBINE", "JAX_EP_NUM_BLOCKS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dispatch_path="push"), "dispatch_path"),
    (dict(combine_path="fused"), "combine_path"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=2.0), "num_blocks"),
    (dict(num_blocks=True), "num_blocks"),
])
def test_bad_fields_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax_ep.Config(**kwargs)


def test_configs_are_hashable_static_values():
    a, b = jax_ep.Config(dispatch_path="pull"), jax_ep.Config(dispatch_path="pull")
    assert a == b and hash(a) == hash(b) and a != jax_ep.Config()


def test_defaults_follow_the_layout(monkeypatch):
    for layout in ("rank_major", "expert_major"):  # no GPU here: the kernels' own CTA count
        assert cfg.resolve(None, layout=layout, **SHAPE) == jax_ep.Config("fused", "pull", None)
    assert cfg.resolve(None, layout="source_slots", **SHAPE).combine_path == "copy"
    # on a GPU of 132 SMs expert_major's combine takes every SM, the rest the kernels' count
    monkeypatch.setattr(cfg, "_multiprocessors", lambda: 132)
    assert cfg.num_blocks(None, layout="expert_major", operation="combine") == 132
    assert cfg.num_blocks(None, layout="expert_major", operation="dispatch") is None
    assert cfg.num_blocks(None, layout="rank_major", operation="combine") is None
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")
    assert cfg.num_blocks(None, layout="expert_major", operation="combine") == 24


def test_explicit_beats_override_beats_default(monkeypatch):
    monkeypatch.setenv("JAX_EP_DISPATCH", "pull")
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "24")
    assert cfg.resolve(None, layout="rank_major", **SHAPE) == jax_ep.Config("pull", "pull", 24)
    explicit = jax_ep.Config(dispatch_path="copy", num_blocks=32)
    assert cfg.resolve(explicit, layout="rank_major", **SHAPE) == jax_ep.Config("copy", "pull",
                                                                                 32)
    monkeypatch.setenv("JAX_EP_DISPATCH", "auto")  # copy where a peer needs >= 85 % of tokens
    assert cfg.dispatch_path(None, layout="rank_major", **SHAPE) == "copy"
    assert cfg.dispatch_path(None, layout="expert_major", **SHAPE) == "fused"
    monkeypatch.setenv("JAX_EP_COMBINE", "bogus")
    with pytest.raises(ValueError, match="JAX_EP_COMBINE"):
        cfg.combine_path(None, layout="rank_major", **SHAPE)


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


def _attrs(text, target):
    """{attribute: value} of each call of `target`, in program order."""
    calls = []
    for line in text.splitlines():
        if f"custom_call @{target}(" in line:
            calls.append({k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", line)})
    return calls


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
    assert dispatch["push"] == _cuda._DISPATCH_MODES["pull"] and dispatch["num_blocks"] == 24
    first, second = _attrs(text, "jax_ep_combine")
    assert first["num_blocks"] == 24 and first["copy_engine"] == 0  # the dispatch's config
    assert second["num_blocks"] == 0 and second["copy_engine"] == 1  # its own


def test_environment_overrides_apply_when_no_config(monkeypatch):
    from jax_ep import _cuda

    monkeypatch.setenv("JAX_EP_DISPATCH", "copy")
    monkeypatch.setenv("JAX_EP_NUM_BLOCKS", "16")

    def fn(x, idx):
        out = _cuda.dispatch(x, None, idx, jnp.ones(idx.shape, jnp.float32),
                             _dispatch_config("rank_major", None))
        return out.x

    (dispatch,) = _attrs(_lower(fn), "jax_ep_dispatch")
    assert dispatch["push"] == _cuda._DISPATCH_MODES["copy"] and dispatch["num_blocks"] == 16


def _dispatch_config(layout, tuning):
    from jax_ep._types import DispatchConfig

    return DispatchConfig(num_experts=2, num_ranks=2, num_tokens=4, hidden=128, num_topk=2,
                          capacity=8, layout=layout, axis_name=AXIS, backend="cuda",
                          tuning=tuning)


def test_the_process_config_fills_what_a_call_leaves_unset(monkeypatch):
    monkeypatch.setenv("JAX_EP_DISPATCH", "pull")
    cfg.set_process_config(jax_ep.Config(dispatch_path="copy", num_blocks=12))
    try:
        assert cfg.resolve(None, layout="rank_major", **SHAPE) == jax_ep.Config("copy", "pull",
                                                                                12)
        mine = jax_ep.Config(dispatch_path="fused")
        assert cfg.resolve(mine, layout="rank_major", **SHAPE) == jax_ep.Config("fused",
                                                                                "pull", 12)
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
    monkeypatch.setenv("JAX_EP_INIT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="JAX_EP_INIT_TIMEOUT_S must be a number"):
        cfg.init_timeout_s()
    monkeypatch.setenv("JAX_EP_COMMAND_BUFFERS", "1")
    assert cfg.command_buffers()
