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
from jax.sharding import PartitionSpec as P

from jax_ep import _cuda
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
        call = re.search(r"stablehlo\.custom_call @(\w+)\(([^)]*)\)", line)
        if call:
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
