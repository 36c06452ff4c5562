"""Tuning of the CUDA data paths: ``jax_ep.Config``, its measured defaults, and every
environment override jax_ep reads.

A ``Config`` is a frozen, hashable dataclass: given as ``config=`` to ``dispatch`` (its handle
keeps it for the combine and both backward passes), ``combine`` or the low-latency dispatch, it
becomes part of the static description of the call, so jit's cache tells programs with
different settings apart. Every field left ``None`` takes, in this order, the process's config
(given to ``jax_ep.runtime.initialize``, which checks that every process passed the same), its
environment override (read here and nowhere else, when the call is traced) or its default
from ``default_config``, a function of the call's shape built from the measured tables in
``benchmarks/RESULTS.md``. The resolved values cross into the extension as typed attributes
of each custom call (``tuning_attributes``); the extension reads no environment variable.

The environment variables, all of them (``ENVIRONMENT``): the data paths, CTAs, copy-engine
chunk size and kernel timeout above, the runtime's buffer sizes and the opt-in
``JAX_EP_COMMAND_BUFFERS``.

The reference backend ignores all of it: it has one data path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax

from jax_ep._types import EXPERT_MAJOR, RANK_MAJOR, SOURCE_SLOTS

DISPATCH_PATHS = ("fused", "pull", "copy")
COMBINE_PATHS = ("pull", "copy", "push")
# The copy-engine paths serve at most this many ranks (kMaxCopyRanks).
MAX_COPY_RANKS = 32
# `auto` picks the copy-engine paths where a peer is expected to need at least this share of
# a rank's tokens: they send every token to every peer (2 and 4 ranks at DeepSeek-V3 shapes).
COPY_MIN_TOKEN_SHARE = 0.85
# Copy-engine transfer size: 16 MB against 8 and 4 on 2×H200 at DeepSeek-V3 shapes (dispatch
# BF16 238 / 252 / 333 µs, source_slots 244 / 265 / 339, combine 278 / 285 / 329;
# benchmarks/RESULTS.md). At those shapes 16 MB is the kernels' floor of 4 chunks per peer.
DEFAULT_COPY_CHUNK_MB = 16.0
# A device-side wait longer than this traps and reports the peer it waited for.
DEFAULT_TIMEOUT_S = 100.0
# CTAs of the SM data paths where nothing else is measured better.
DEFAULT_BLOCKS = 64
# CTAs of a split low-latency call (its kernel runs beside the work between send and receive,
# which takes the other SMs), decode shapes, beside the benchmark's matmul (XLA's one-wave GEMM
# on 120 SMs), steady (benchmarks/RESULTS.md). Fewer CTAs leave the GEMM more SMs, but the
# kernel, sharing HBM with it, may then outlast it; where that turns depends on the device:
# - 2×H100 (2026-11-28, c1652e3; 99 µs matmul): send -> matmul -> receive 115.5-116.0 µs with
#   8, 119.3-120.9 with 16, 120.5-121.4 with 12, 120.7-121.7 with 32 (in one lease of four,
#   and the day before, 8 and 16 tied); combine send -> matmul -> receive 138.5 with 8,
#   122.3-123.2 with 16, 122.2-122.6 with 32.
# - 2×H200 (2026-11-28, 6a28c1a's and cadafe7's kernels, two runs each; 92.6-93.1 µs matmul):
#   send 117.0-118.0 with 8, 115.9-116.3 with 12, 108.8-110.7 with 16, 111.3-111.7 with 32;
#   combine 117.2-117.8 with 16, 110.9-112.2 with 32. A later run (4679ada's kernels, 92.4 µs
#   matmul): send 117.3 with 8 and 12, 112.1 with 16, 111.9 with 20, 112.7 with 24, 113.9
#   with 32; combine 115.1 with 16, 112.6 with 24, 113.9 with 32, 113.8 with 40.
# - Beside a GEMM that leaves the split call its SMs (`experts.batched_matmul(...,
#   sm_count=num_sms - 16)` on 116 SMs, 2×H200, 2026-11-28, a60c870): combine 86.3 µs steady
#   with 16 CTAs against 122.6 with 32 and 117.8 with 40 (matmul alone 79.0): the kernel at
#   32 waits for SMs the GEMM holds. Beside XLA's GEMM on every SM the same run had 115.5
#   with 16 against 110.5 with 32.
# So the dispatch takes 16 on an H200 and 8 elsewhere, and the combine 16 everywhere (H100:
# level with 32 beside XLA's GEMM), so that a GEMM sized for the SMs the dispatch leaves on an
# H200 leaves the combine its SMs too.
LOW_LATENCY_SPLIT_DISPATCH_BLOCKS = {"H200": 16}  # device kind contains -> CTAs
LOW_LATENCY_SPLIT_DISPATCH_BLOCKS_ELSEWHERE = 8
LOW_LATENCY_SPLIT_COMBINE_BLOCKS = 16
# Where the processes reach each other's XLA arrays (runtime.xla_windows_open) the pull
# combine reads y in place and is rank_major's default: 209 µs against the push's 240 on
# 2×H100 at DeepSeek-V3 shapes with 64 CTAs. Where they do not, the pull stages y first and
# the push is the default where it gets at least this many CTAs: 242 µs against the staged
# pull's 258 with 64 CTAs and 238 against 255 with 128, but 343 against 280 with 24
# (benchmarks/RESULTS.md).
PUSH_COMBINE_MIN_BLOCKS = 64

# Every JAX_EP_* variable that changes what jax_ep does, read in this module only.
ENVIRONMENT = {
    "JAX_EP_DISPATCH": "Config.dispatch_path where unset (also `auto`)",
    "JAX_EP_COMBINE": "Config.combine_path where unset (also `auto`)",
    "JAX_EP_NUM_BLOCKS": "Config.num_blocks where unset",
    "JAX_EP_COPY_CHUNK_MB": "Config.copy_chunk_mb where unset",
    "JAX_EP_TIMEOUT_S": "Config.timeout_s where unset",
    "JAX_EP_BUFFER_BYTES": "the symmetric buffer where initialize() gets no size",
    "JAX_EP_LL_BUFFER_BYTES": "the low-latency buffer where initialize() gets none",
    "JAX_EP_COMMAND_BUFFERS": "1: every custom call may be recorded into XLA's command buffers",
}


def _positive_number(value, name, integral):
    kinds = (int,) if integral else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        what = "an int >= 1" if integral else "a number > 0"
        raise ValueError(f"Config.{name} must be {what} or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning of the CUDA kernels (``None``: the process's config, the override or the default).

    dispatch_path: ``"fused"`` (senders store rows into the receivers' buffers over NVLink
        and, in the same kernel, the receivers move complete chunks out; at most 16
        destinations per token), ``"pull"`` (receivers load rows from the senders' buffers:
        no such limit) or ``"copy"`` (the copy engines send every token to every peer; at most
        32 ranks). The source_slots layout moves its rows with ``"fused"`` by the SMs, which
        store each row at its fixed place in every destination as soon as the call starts
        (no count exchange in front), or by the copy engines (``"copy"``).
    combine_path: ``"pull"`` (the token owners load the expert ranks' rows, in place where
        the XLA windows are open, else staged),
        ``"copy"`` (rank_major and source_slots: the expert ranks' copy engines send each
        owner its rows) or ``"push"`` (rank_major: the expert ranks store each owner's rows
        into its buffer, and the owner sums them as they arrive, in one kernel); expert_major
        always pulls.
    num_blocks: CTAs of each communication kernel, the SMs it may take (>= 1).
    copy_chunk_mb: MB of rows per copy-engine transfer (every rank must use the same).
    timeout_s: how long a kernel waits for a peer before it traps, naming the peer.
    stream: the XLA GPU stream the dispatch and the combine (and their backward passes) run
        on: 0, the program's main stream (the default), or n >= 1, an async call on XLA's
        stream n (``jax.experimental.compute_on``, ``"gpu_stream:n"``), so that work of the
        same program that needs nothing from the call runs beside it on the SMs the call
        leaves free (2×H100, DeepSeek-V3 shapes: a dispatch and an independent matmul of
        207 and 185 µs take 388 µs together on one stream, 291 with the dispatch on stream 1;
        benchmarks/RESULTS.md). It overlaps only where XLA's scheduler starts the call before
        that work, which it did for the dispatch and not for the combine: the work as the
        stream call (``jax_ep.on_stream``) overlaps both. The calls of one process share one
        symmetric workspace, so calls XLA may run at the same time must be on the same
        stream (a handle keeps its dispatch's stream for the combine and the backward passes;
        the process's config, ``runtime.initialize(config=Config(stream=1))``, puts every
        call there). Needs jax >= 0.10. The reference backend ignores it (its XLA
        collectives cannot run in such a call); the low-latency calls take no stream (their
        split send/receive is their overlap).
    """

    dispatch_path: str | None = None
    combine_path: str | None = None
    num_blocks: int | None = None
    copy_chunk_mb: float | None = None
    timeout_s: float | None = None
    stream: int | None = None

    def __post_init__(self):
        if self.dispatch_path is not None and self.dispatch_path not in DISPATCH_PATHS:
            raise ValueError(f"Config.dispatch_path must be one of {DISPATCH_PATHS} or None, "
                             f"got {self.dispatch_path!r}")
        if self.combine_path is not None and self.combine_path not in COMBINE_PATHS:
            raise ValueError(f"Config.combine_path must be one of {COMBINE_PATHS} or None, "
                             f"got {self.combine_path!r}")
        if self.num_blocks is not None:
            _positive_number(self.num_blocks, "num_blocks", integral=True)
        if self.copy_chunk_mb is not None:
            _positive_number(self.copy_chunk_mb, "copy_chunk_mb", integral=False)
        if self.timeout_s is not None:
            _positive_number(self.timeout_s, "timeout_s", integral=False)
        if self.stream is not None and (isinstance(self.stream, bool)
                                        or not isinstance(self.stream, int) or self.stream < 0):
            raise ValueError(f"Config.stream must be an int >= 0 or None, got {self.stream!r}")


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


def copy_engine_blocks(num_ranks) -> int:
    """CTAs of the copy-engine paths. They only copy locally and need only keep pace with the
    engines: a rank's peers' rows arrive at ~382 GB/s (2×H200, both directions busy) and its
    own rows, R/(R-1) as many in all, need copying in the same time, ~24 GB/s per CTA: 32
    CTAs on 2 ranks (measured: 230.5 µs against 237.7 with 24, dispatch BF16; combine 266.7
    against 278.8), 22 on 4, 19 on 8. The extension caps them at all SMs but two (the chunks'
    landed flags are raised by one-thread kernels that need room beside the waiting CTAs)."""
    peers = max(int(num_ranks) - 1, 1)
    need = 382.0 * (peers + 1) / peers / 24.0
    return min(max(math.ceil(need - 1e-9), 8), DEFAULT_BLOCKS)


def default_blocks(layout, operation="dispatch", *, path=None, num_ranks=2) -> int:
    """CTAs per kernel. The copy-engine paths: ``copy_engine_blocks``. expert_major's combine
    and cached dispatch (the combine's backward) take every SM: they sum or copy ~4x
    rank_major's rows through HBM (2×H200: combine 355 -> 289 µs with 132 CTAs instead of 64).
    Everything else 64 (the expert_major dispatch 297 µs with 64, 309 with 132; rank_major's
    227 and 235; 24 CTAs: 260 / 266 µs)."""
    if path == "copy":
        return copy_engine_blocks(num_ranks)
    if layout == EXPERT_MAJOR and operation != "dispatch":
        return _multiprocessors() or DEFAULT_BLOCKS
    return DEFAULT_BLOCKS


def _reads_in_place() -> bool:
    """Whether the processes reach each other's XLA arrays (``initialize`` mapped them), so
    that the pull combine reads y where XLA keeps it instead of from a staged copy."""
    from jax_ep import runtime  # runtime imports this module
    return runtime.xla_windows_open()


def default_config(num_ranks, num_topk, num_experts, layout, operation="dispatch") -> Config:
    """The measured defaults for a call's shape (benchmarks/RESULTS.md). On two GPUs at
    DeepSeek-V3 shapes the fused dispatch wins in every layout (2×H100: rank_major BF16
    225.7 µs against 241.9 for the copy engines; expert_major 322.4 against 522.9;
    source_slots by the SMs 220.3 against 256.1); where the XLA windows are open rank_major's
    is the lean push, which wins at 24 CTAs too (222.9 against the pull's 243.1),
    source_slots' only there (``_reads_in_place``: its rows land straight in the outputs),
    else its copy engines. The combine: the pull where
    it reads the peers' y in place (rank_major 213.3 µs against the push's 260.8,
    source_slots 210.6 against 245.8 by copy engines), else for rank_major the push (242 µs
    against the staged pull's 258; ``combine_path`` falls back to pull below
    ``PUSH_COMBINE_MIN_BLOCKS`` CTAs) and for source_slots the copy engines; expert_major
    always pulls. ``num_blocks``: ``default_blocks`` of the operation's path."""
    del num_topk, num_experts  # one answer so far on every measured shape
    in_place = _reads_in_place()
    dispatch = "copy" if layout == SOURCE_SLOTS and not in_place else "fused"
    combine = {RANK_MAJOR: "pull" if in_place else "push",
               SOURCE_SLOTS: "pull" if in_place else "copy"}.get(layout, "pull")
    path = dispatch if operation == "dispatch" else combine
    return Config(dispatch_path=dispatch, combine_path=combine,
                  num_blocks=default_blocks(layout, operation, path=path, num_ranks=num_ranks),
                  copy_chunk_mb=DEFAULT_COPY_CHUNK_MB, timeout_s=DEFAULT_TIMEOUT_S)


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


def _number(name, default, kind):
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return kind(float(value)) if kind is int else kind(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def dispatch_path(config: Config | None, *, num_ranks, num_topk, num_experts, layout) -> str:
    """The call's value, else the process's, else ``JAX_EP_DISPATCH`` (fused | pull | copy |
    auto; auto: the copy engines for rank_major where a peer is expected to need >= 85 % of
    the tokens, else fused), else the default (``default_config``)."""
    path = _field(config, "dispatch_path")
    path = path or _override("JAX_EP_DISPATCH", DISPATCH_PATHS + ("auto",))
    if path == "auto":
        pays = layout == SOURCE_SLOTS or _copy_pays(num_ranks, num_topk, num_experts, layout)
        return "copy" if pays else "fused"
    if path is None:
        path = default_config(num_ranks, num_topk, num_experts, layout).dispatch_path
    return path


def combine_path(config: Config | None, *, num_ranks, num_topk, num_experts, layout) -> str:
    """The call's value, else the process's, else ``JAX_EP_COMBINE`` (pull | copy | push |
    auto: copy where the dispatch's auto would pick it, else the default), else the default:
    for rank_major the pull where it reads the peers' y in place, else the push where the
    combine gets at least ``PUSH_COMBINE_MIN_BLOCKS`` CTAs, else the pull (source_slots:
    copy). expert_major always pulls."""
    path = _field(config, "combine_path")
    path = path or _override("JAX_EP_COMBINE", COMBINE_PATHS + ("auto",))
    if path == "auto":
        path = "copy" if _copy_pays(num_ranks, num_topk, num_experts, layout) else None
    if path is None:
        path = default_config(num_ranks, num_topk, num_experts, layout).combine_path
        if path == "push" and num_blocks(config, layout=layout, operation="combine", path=path,
                                         num_ranks=num_ranks) < PUSH_COMBINE_MIN_BLOCKS:
            path = "pull"
    if path == "push":  # rank_major's path only (others take their default)
        return path if layout == RANK_MAJOR else default_config(
            num_ranks, num_topk, num_experts, layout).combine_path
    return "pull" if layout == EXPERT_MAJOR or num_ranks > MAX_COPY_RANKS else path


def num_blocks(config: Config | None, *, layout=None, operation="dispatch", path=None,
               num_ranks=2) -> int:
    """The call's value, else the process's, else ``JAX_EP_NUM_BLOCKS``, else the default for
    the layout, operation and path (``default_blocks``)."""
    given = _field(config, "num_blocks")
    if given is not None:
        return given
    value = os.environ.get("JAX_EP_NUM_BLOCKS", "")
    if value in ("", "0"):
        return default_blocks(layout, operation, path=path, num_ranks=num_ranks)
    return Config(num_blocks=int(value)).num_blocks  # validated


def _positive_field(config: Config | None, name: str, variable: str, default: float) -> float:
    """The call's value of a positive number field, else the process's, else the variable's
    (validated as the field), else ``default``."""
    given = _field(config, name)
    if given is None:
        value = _number(variable, None, float)
        given = getattr(Config(**{name: value}), name) if value else default
    return float(given)


def copy_chunk_mb(config: Config | None) -> float:
    """The call's value, else the process's, else ``JAX_EP_COPY_CHUNK_MB``, else 16."""
    return _positive_field(config, "copy_chunk_mb", "JAX_EP_COPY_CHUNK_MB", DEFAULT_COPY_CHUNK_MB)


def timeout_s(config: Config | None) -> float:
    """The call's value, else the process's, else ``JAX_EP_TIMEOUT_S``, else 100."""
    return _positive_field(config, "timeout_s", "JAX_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def stream(config: Config | None) -> int:
    """The call's value, else the process's, else 0 (the program's main stream)."""
    value = _field(config, "stream")
    return 0 if value is None else value


def resolve(config: Config | None, *, num_ranks, num_topk, num_experts, layout,
            operation="dispatch") -> Config:
    """Every field set (explicit, the process's, overridden or default) for a call of this
    shape; ``num_blocks`` for ``operation`` ("dispatch", or "combine" for the combine and the
    cached dispatch) on its path."""
    shape = dict(num_ranks=num_ranks, num_topk=num_topk, num_experts=num_experts, layout=layout)
    dispatch, combine = dispatch_path(config, **shape), combine_path(config, **shape)
    path = dispatch if operation == "dispatch" else combine
    return Config(dispatch_path=dispatch, combine_path=combine,
                  num_blocks=num_blocks(config, layout=layout, operation=operation, path=path,
                                        num_ranks=num_ranks),
                  copy_chunk_mb=copy_chunk_mb(config), timeout_s=timeout_s(config))


def split_dispatch_blocks(device_kind: str) -> int:
    """CTAs of a split low-latency dispatch on a device of this kind (``Device.device_kind``):
    ``LOW_LATENCY_SPLIT_DISPATCH_BLOCKS``' entry whose name the kind contains, else
    ``LOW_LATENCY_SPLIT_DISPATCH_BLOCKS_ELSEWHERE``."""
    kind = device_kind.upper()
    return next((blocks for name, blocks in LOW_LATENCY_SPLIT_DISPATCH_BLOCKS.items()
                 if name in kind), LOW_LATENCY_SPLIT_DISPATCH_BLOCKS_ELSEWHERE)


def resolve_low_latency(config: Config | None, *, split: str | None = None,
                        device_kind: str = "") -> Config:
    """A low-latency call's fields: its CTAs (given or ``JAX_EP_NUM_BLOCKS``; else, for a
    split call (``split`` "dispatch" or "combine"), ``split_dispatch_blocks(device_kind)`` or
    ``LOW_LATENCY_SPLIT_COMBINE_BLOCKS``, and None for the others: one per SM, the kernels'
    own) and its timeout; it has no data path to choose."""
    if split not in (None, "dispatch", "combine"):
        raise ValueError(f"split: 'dispatch', 'combine' or None, got {split!r}")
    given = _field(config, "num_blocks")
    value = os.environ.get("JAX_EP_NUM_BLOCKS", "")
    if given is None and value not in ("", "0"):
        given = Config(num_blocks=int(value)).num_blocks
    if given is None and split is not None:
        given = (split_dispatch_blocks(device_kind) if split == "dispatch"
                 else LOW_LATENCY_SPLIT_COMBINE_BLOCKS)
    return Config(num_blocks=given, copy_chunk_mb=DEFAULT_COPY_CHUNK_MB,
                  timeout_s=timeout_s(config))


def tuning_attributes(resolved: Config, *, num_blocks: int | None = None) -> dict:
    """A resolved config as the custom calls' ``tuning`` attribute (a dictionary the extension
    decodes into its ``Tuning`` struct). ``num_blocks`` 0: the kernel's own count (the
    low-latency kernels: one per SM)."""
    blocks = resolved.num_blocks if num_blocks is None else num_blocks
    return dict(num_blocks=int(blocks or 0),
                copy_chunk_bytes=int(resolved.copy_chunk_mb * (1 << 20)),
                timeout_s=float(resolved.timeout_s))


# ----------------------------------------------------------------------------- runtime variables

def buffer_bytes_override(default: int) -> int:
    """``JAX_EP_BUFFER_BYTES``, else ``default``: the symmetric buffer when ``initialize`` is
    given neither a size nor shapes."""
    return _number("JAX_EP_BUFFER_BYTES", default, int)


def low_latency_bytes_override() -> int:
    """``JAX_EP_LL_BUFFER_BYTES``, else 0 (no low-latency buffer)."""
    return _number("JAX_EP_LL_BUFFER_BYTES", 0, int)


def command_buffers() -> bool:
    """``JAX_EP_COMMAND_BUFFERS=1``: every custom call is declared command-buffer compatible
    (XLA may record it into CUDA graphs); unset, only the local ones (``_native.LOCAL_TARGETS``)."""
    return os.environ.get("JAX_EP_COMMAND_BUFFERS", "0") == "1"
