"""Tuning of the CUDA data paths: ``jax_ep.Config``, its defaults, and the environment overrides.

A ``Config`` is a frozen, hashable dataclass: given as ``config=`` to ``dispatch`` (its handle
keeps it for the combine and both backward passes) or ``combine``, it becomes part of the
static description of the call, so jit's cache tells programs with different settings apart.
Every field left ``None`` takes, in this order, the process's config (given to
``jax_ep.runtime.initialize``, which checks that every process passed the same), its
environment override (read here and nowhere else in Python, when the call is traced) or its
default from ``default_config``, a function of the call's shape built from the measured tables
in ``benchmarks/RESULTS.md``.

The reference backend ignores all of it: it has one data path.

The runtime's sizes and timeouts have their environment overrides read here too
(``JAX_EP_BUFFER_BYTES``, ``JAX_EP_LL_BUFFER_BYTES``, ``JAX_EP_INIT_TIMEOUT_S``,
``JAX_EP_FINALIZE_TIMEOUT_S``) and so has the opt-in ``JAX_EP_COMMAND_BUFFERS``; the
extension still reads its own (the copy engines' knobs, the kernels' timeout, the launch mode).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from jax_ep._types import EXPERT_MAJOR, SOURCE_SLOTS

DISPATCH_PATHS = ("fused", "pull", "copy")
COMBINE_PATHS = ("pull", "copy")
# The copy-engine paths serve at most this many ranks (kMaxCopyRanks).
MAX_COPY_RANKS = 32
# `auto` picks the copy-engine paths where a peer is expected to need at least this share of
# a rank's tokens: they send every token to every peer (2 and 4 ranks at DeepSeek-V3 shapes).
COPY_MIN_TOKEN_SHARE = 0.85


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the CUDA kernels' data paths (``None``: the override or the default).

    dispatch_path: ``"fused"`` (senders store rows into the receivers' buffers over NVLink
        and, in the same kernel, the receivers move complete chunks out; at most 16
        destinations per token), ``"pull"`` (receivers load rows from the senders' buffers:
        no such limit) or ``"copy"`` (the copy engines send every token to every peer; at most
        32 ranks). The source_slots layout always moves its rows by the copy engines.
    combine_path: ``"pull"`` (the token owners load the expert ranks' staged rows) or
        ``"copy"`` (rank_major and source_slots: the expert ranks' copy engines send each
        owner its rows; expert_major always pulls).
    num_blocks: CTAs of each communication kernel, the SMs it may take (>= 1).
    """

    dispatch_path: str | None = None
    combine_path: str | None = None
    num_blocks: int | None = None

    def __post_init__(self):
        if self.dispatch_path is not None and self.dispatch_path not in DISPATCH_PATHS:
            raise ValueError(f"Config.dispatch_path must be one of {DISPATCH_PATHS} or None, "
                             f"got {self.dispatch_path!r}")
        if self.combine_path is not None and self.combine_path not in COMBINE_PATHS:
            raise ValueError(f"Config.combine_path must be one of {COMBINE_PATHS} or None, "
                             f"got {self.combine_path!r}")
        if self.num_blocks is not None and (isinstance(self.num_blocks, bool)
                                            or not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 1):
            raise ValueError(f"Config.num_blocks must be an int >= 1 or None, "
                             f"got {self.num_blocks!r}")


# ----------------------------------------------------------------------------- defaults

def expected_token_share(num_ranks, num_topk, num_experts) -> float:
    """Share of a rank's tokens that one given peer needs when each token picks num_topk
    distinct experts uniformly at random: 1 - C(E - L, K) / C(E, K), L = E / R."""
    E, K = int(num_experts), int(num_topk)
    L = E // max(int(num_ranks), 1)
    miss = 1.0
    for i in range(min(K, E)):  # C(E - L, K) / C(E, K) as a product
        miss *= max(E - L - i, 0) / (E - i)
    return 1.0 - miss


def _copy_pays(num_ranks, num_topk, num_experts, layout) -> bool:
    return (layout != EXPERT_MAJOR and 1 < num_ranks <= MAX_COPY_RANKS
            and expected_token_share(num_ranks, num_topk, num_experts) >= COPY_MIN_TOKEN_SHARE)


@functools.cache
def _multiprocessors() -> int | None:
    """SMs of this process's GPU (None without one)."""
    try:
        device = jax.local_devices()[0]
    except RuntimeError:
        return None
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else None


def default_blocks(layout, operation="dispatch") -> int | None:
    """CTAs per kernel. expert_major's combine and cached dispatch (the combine's backward)
    take every SM: they sum or copy ~4x rank_major's rows through HBM (2×H200: combine 355 ->
    289 µs with 132 CTAs instead of 64). Everything else is left to the kernels: 64 CTAs for
    the SM paths (the expert_major dispatch 297 µs with 64, 309 with 132; rank_major's 227
    and 235), the copy-engine paths sized to keep pace with the engines (24 on 2 ranks)."""
    if layout == EXPERT_MAJOR and operation != "dispatch":
        return _multiprocessors()
    return None


def default_config(num_ranks, num_topk, num_experts, layout) -> Config:
    """The measured defaults for a call's shape (benchmarks/RESULTS.md). On two GPUs at
    DeepSeek-V3 shapes the fused dispatch and the pull combine win in every layout but
    source_slots, which exists for its copy engines: fused BF16 233.7 µs against 380.5 for the
    copy engines (2×H200) and 269.6 against ~800 for expert_major; combine pull 251.8 against
    294.5. ``num_blocks``: ``default_blocks``."""
    del num_ranks, num_topk, num_experts  # one answer so far on every measured shape
    return Config(dispatch_path="fused",
                  combine_path="copy" if layout == SOURCE_SLOTS else "pull",
                  num_blocks=default_blocks(layout))  # the dispatch's


# ----------------------------------------------------------------------------- overrides

_process_config: Config | None = None


def set_process_config(config: Config | None) -> None:
    """The fields every call of this process takes where its own config leaves them None
    (``jax_ep.runtime.initialize(config=...)`` sets it once the processes agree on it)."""
    global _process_config
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a jax_ep.Config or None, got {type(config).__name__}")
    _process_config = config


def _field(config: Config | None, name: str):
    value = getattr(config, name) if config is not None else None
    if value is None and _process_config is not None:
        value = getattr(_process_config, name)
    return value


# Variables that choose what the peers read or write: a process whose kernels expect another
# data path or chunking than its peers' would wait for data that never comes.
# (``jax_ep.runtime.initialize`` compares them across processes.)
SHARED_VARIABLES = ("JAX_EP_DISPATCH", "JAX_EP_COMBINE", "JAX_EP_COPY_CHUNK_MB")


def shared_variable(name: str):
    """A shared variable's value as the backend reads it (equal spellings compare equal)."""
    value = os.environ.get(name)
    if name == "JAX_EP_DISPATCH" and value is None:
        return "fused"
    if name == "JAX_EP_COPY_CHUNK_MB" and value is not None:
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _override(name, allowed):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")
    return value


def dispatch_path(config: Config | None, *, num_ranks, num_topk, num_experts, layout) -> str:
    """The call's value, else the process's, else ``JAX_EP_DISPATCH`` (fused | pull | copy |
    auto; auto: the copy engines for rank_major where a peer is expected to need >= 85 % of
    the tokens, else fused), else the default."""
    path = _field(config, "dispatch_path")
    path = path or _override("JAX_EP_DISPATCH", DISPATCH_PATHS + ("auto",))
    if path == "auto":
        return "copy" if _copy_pays(num_ranks, num_topk, num_experts, layout) else "fused"
    return path or default_config(num_ranks, num_topk, num_experts, layout).dispatch_path


def combine_path(config: Config | None, *, num_ranks, num_topk, num_experts, layout) -> str:
    """The call's value, else the process's, else ``JAX_EP_COMBINE`` (pull | copy | auto, as
    for the dispatch), else the default."""
    path = _field(config, "combine_path")
    path = path or _override("JAX_EP_COMBINE", COMBINE_PATHS + ("auto",))
    if path == "auto":
        return "copy" if _copy_pays(num_ranks, num_topk, num_experts, layout) else "pull"
    return path or default_config(num_ranks, num_topk, num_experts, layout).combine_path


def num_blocks(config: Config | None, *, layout=None, operation="dispatch") -> int | None:
    """The call's value, else the process's, else ``JAX_EP_NUM_BLOCKS``, else the default for
    the layout and operation (``default_blocks``; None: each kernel's own)."""
    given = _field(config, "num_blocks")
    if given is not None:
        return given
    value = os.environ.get("JAX_EP_NUM_BLOCKS", "")
    if value in ("", "0"):
        return default_blocks(layout, operation)
    return Config(num_blocks=int(value)).num_blocks  # validated


def resolve(config: Config | None, *, num_ranks, num_topk, num_experts, layout) -> Config:
    """Every path set (explicit, overridden or default) for a call of this shape."""
    shape = dict(num_ranks=num_ranks, num_topk=num_topk, num_experts=num_experts, layout=layout)
    return Config(dispatch_path=dispatch_path(config, **shape),
                  combine_path=combine_path(config, **shape),
                  num_blocks=num_blocks(config, layout=layout))


# ----------------------------------------------------------------------------- runtime variables

def _number(name, default, kind):
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return kind(float(value)) if kind is int else kind(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def buffer_bytes_override(default: int) -> int:
    """``JAX_EP_BUFFER_BYTES``, else ``default``: the symmetric buffer when ``initialize`` is
    given neither a size nor shapes."""
    return _number("JAX_EP_BUFFER_BYTES", default, int)


def low_latency_bytes_override() -> int:
    """``JAX_EP_LL_BUFFER_BYTES``, else 0 (no low-latency buffer)."""
    return _number("JAX_EP_LL_BUFFER_BYTES", 0, int)


def init_timeout_s() -> float:
    """``JAX_EP_INIT_TIMEOUT_S``, else 300: how long ``initialize`` waits for the other
    processes' posts in jax.distributed's key-value store."""
    return _number("JAX_EP_INIT_TIMEOUT_S", 300.0, float)


def finalize_timeout_s() -> float:
    """``JAX_EP_FINALIZE_TIMEOUT_S``, else 60: how long ``finalize`` waits for NVSHMEM."""
    return _number("JAX_EP_FINALIZE_TIMEOUT_S", 60.0, float)


def command_buffers() -> bool:
    """``JAX_EP_COMMAND_BUFFERS=1``: the custom calls are declared command-buffer compatible
    (XLA may record them into CUDA graphs); off unless set."""
    return os.environ.get("JAX_EP_COMMAND_BUFFERS", "0") == "1"
