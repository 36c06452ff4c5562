"""The communication runtime: NVSHMEM bootstrapped from ``jax.distributed``, one process per GPU.

Typical use, in a script started by ``python -m jax_ep.launch -n <gpus> script.py``::

    from jax_ep import launch, runtime
    launch.init_distributed()      # jax.distributed.initialize(..., local_device_ids=[rank])
    runtime.initialize()           # NVSHMEM + the symmetric buffer, before the first CUDA call

``initialize`` must follow ``jax.distributed.initialize`` (a single process that owns one GPU may
skip it). Process 0 creates NVSHMEM's unique id and publishes it through jax.distributed's
key-value store; every process joins with it, checks that its NVSHMEM PE equals its JAX process
index (the rank along the expert-parallel mesh axis), and allocates the symmetric buffer, the
same size everywhere.

Buffer size: ``buffer_bytes``, else a size computed from the shapes you pass (``num_tokens``,
``hidden``, ...), else ``JAX_EP_BUFFER_BYTES``, else ``DEFAULT_BUFFER_BYTES`` (1 GiB, enough for
DeepSeek-V3 shapes, 4096 tokens x 7168 bf16 per GPU, on up to 8 GPUs).

Low-latency buffer: the decode kernels (``jax_ep.low_latency_*``) use a second symmetric
allocation, ``low_latency_bytes``, else ``JAX_EP_LL_BUFFER_BYTES``, else none (0);
``jax_ep.low_latency_buffer_size_hint(...)`` gives the size for your shapes.

GPU memory: the buffer is allocated outside XLA, while XLA preallocates 75% of each GPU by
default. Importing this module lowers that default to 70% (only if
``XLA_PYTHON_CLIENT_MEM_FRACTION`` is unset and JAX has not created its GPU client yet). If the
allocation fails, set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` lower or
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX starts.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import socket
import sys
import threading
import warnings

import numpy as np

from jax_ep import _native
from jax_ep import config as _config

DEFAULT_BUFFER_BYTES = 1 << 30
_KEY_PREFIX = "jax_ep/runtime"
# How long finalize at exit waits for the other processes before it gives up on them.
FINALIZE_AT_EXIT_TIMEOUT_S = 60.0

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")

_generation = 0  # initialize() calls so far: a fresh key-value namespace for each
_atexit_registered = False
_xla_windows_open = False
_xla_window = (0, 0)  # this process's allocation of XLA's memory that its peers map: base, size


def default_buffer_bytes() -> int:
    """The buffer size used when ``initialize`` is given neither a size nor shapes."""
    return _config.buffer_bytes_override(DEFAULT_BUFFER_BYTES)


def _module():
    module, why = _native.load()
    if module is None:
        raise RuntimeError(why)
    return module


def _distributed_client():
    from jax._src import distributed

    return distributed.global_state.client


def is_initialized() -> bool:
    module, _ = _native.load()
    return module is not None and module.is_initialized()


def buffer_bytes() -> int:
    """Bytes of the symmetric buffer (0 before ``initialize``)."""
    module, _ = _native.load()
    return module.buffer_bytes() if module is not None else 0


def low_latency_buffer_bytes() -> int:
    """Bytes of the low-latency buffer (0 before ``initialize`` or when it has none)."""
    module, _ = _native.load()
    return module.low_latency_buffer_bytes() if module is not None else 0


def default_low_latency_bytes() -> int:
    """The low-latency buffer size used when ``initialize`` is not given one."""
    return _config.low_latency_bytes_override()


def _size_from_shapes(num_ranks, num_tokens, hidden, num_topk, num_experts, capacity, dtype,
                      layout, fp8, alignment=1) -> int:
    missing = [name for name, value in (("num_tokens", num_tokens), ("hidden", hidden),
                                        ("num_topk", num_topk), ("num_experts", num_experts))
               if value is None]
    if missing:
        raise ValueError(f"initialize: sizing the buffer from shapes also needs {missing}")
    import jax.numpy as jnp

    from jax_ep import _cuda

    return int(_cuda.buffer_size_hint(
        num_tokens, hidden, num_topk, num_experts, num_ranks, capacity=capacity,
        dtype=jnp.bfloat16 if dtype is None else dtype, layout=layout, fp8=fp8,
        alignment=alignment))


# (The block count and the copy engines' enqueueing variables only shape a rank's own work.)
SHARED_VARIABLES = _config.SHARED_VARIABLES


def _shared_settings(buffer_bytes: int, low_latency_bytes: int, config=None,
                     node_size=None) -> dict:
    """What every process must agree on: the symmetric allocations (NVSHMEM allocates them
    collectively, the same size on every PE), the process's ``jax_ep.Config``, the nodes and
    SHARED_VARIABLES."""
    settings = {"buffer_bytes": buffer_bytes, "low_latency_bytes": low_latency_bytes,
                "config": None if config is None else dataclasses.asdict(config),
                "node_size": node_size}
    settings.update({name: _config.shared_variable(name) for name in SHARED_VARIABLES})
    return settings


def _check_same_settings(settings_by_rank: list[dict]) -> None:
    """Raises on every process alike (each reads every process's settings), before any of
    them joins NVSHMEM, so that a mismatch, or an error of one process's arguments, is an
    error everywhere and not a hang."""
    failed = [f"rank {r}: {s['error']}" for r, s in enumerate(settings_by_rank) if s.get("error")]
    if failed:
        raise ValueError("jax_ep.runtime.initialize failed on " + "; ".join(failed))
    differing = []
    for key in settings_by_rank[0]:
        values = [settings.get(key) for settings in settings_by_rank]
        if len(set(map(repr, values))) > 1:
            unset = "unset"
            listed = ", ".join(f"rank {r}: {unset if v is None else v}"
                               for r, v in enumerate(values))
            differing.append(f"{key} ({listed})")
    if differing:
        raise ValueError("jax_ep.runtime.initialize: every process must pass the same sizes and "
                         "set the same jax_ep variables; they differ in " + "; ".join(differing))


def _exchange(client, rank, world, generation, settings, timeout_ms=300_000) -> list[dict]:
    """Every process's settings and host name, through jax.distributed's key-value store."""
    mine = dict(settings, host=socket.gethostname())
    if world == 1:
        return [mine]
    prefix = f"{_KEY_PREFIX}/{generation}/settings"
    client.key_value_set(f"{prefix}/{rank}", json.dumps(mine))
    return [json.loads(client.blocking_key_value_get(f"{prefix}/{r}", timeout_ms))
            for r in range(world)]


def _agree(client, rank, world, generation, settings, timeout_s=300.0) -> list[str]:
    """Exchanges and checks the settings; returns every process's host name, by rank. Ends in
    a barrier: a process that arrives after the others gave up waiting for it fails there too,
    instead of joining an NVSHMEM job nobody else joins."""
    timeout_ms = int(timeout_s * 1000)
    everyone = _exchange(client, rank, world, generation, settings, timeout_ms)
    hosts = [entry.pop("host") for entry in everyone]
    _check_same_settings(everyone)
    if world > 1:
        client.wait_at_barrier(f"{_KEY_PREFIX}/{generation}/agreed", timeout_ms)
    return hosts


def nodes_of(hosts: list[str], node_size: int | None = None) -> list[int]:
    """The node of every rank: one per host (numbered by first appearance), or, with
    ``node_size``, virtual nodes of that many consecutive ranks (to run the node-bound
    checks on one host); a virtual node may not span hosts."""
    world = len(hosts)
    if node_size is None:
        index = {}
        return [index.setdefault(host, len(index)) for host in hosts]
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 \
            or world % node_size:
        raise ValueError(f"node_size must be an int >= 1 dividing the {world} processes, got "
                         f"{node_size!r}")
    nodes = [r // node_size for r in range(world)]
    for node in range(world // node_size):
        spanned = sorted({hosts[r] for r in range(world) if nodes[r] == node})
        if len(spanned) > 1:
            raise ValueError(f"node_size={node_size}: node {node} would span the hosts "
                             f"{spanned}")
    return nodes


def _requested_sizes(world, buffer_bytes, low_latency_bytes, num_tokens, hidden, num_topk,
                     num_experts, capacity, dtype, layout, fp8, alignment) -> tuple[int, int]:
    if buffer_bytes is None:
        if num_tokens is not None or hidden is not None:
            buffer_bytes = _size_from_shapes(world, num_tokens, hidden, num_topk, num_experts,
                                             capacity, dtype, layout, fp8, alignment)
        else:
            buffer_bytes = default_buffer_bytes()
    buffer_bytes = int(buffer_bytes)
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    if low_latency_bytes is None:
        low_latency_bytes = default_low_latency_bytes()
    low_latency_bytes = int(low_latency_bytes)
    if low_latency_bytes < 0:
        raise ValueError(f"low_latency_bytes must be >= 0, got {low_latency_bytes}")
    return buffer_bytes, low_latency_bytes


def initialize(buffer_bytes: int | None = None, *, num_tokens: int | None = None,
               hidden: int | None = None, num_topk: int | None = None,
               num_experts: int | None = None, capacity: int | None = None, dtype=None,
               layout: str = "rank_major", fp8: bool = False, alignment: int = 1,
               low_latency_bytes: int | None = None, config=None,
               init_timeout_s: float = 300.0, fault_exit_s: float = 10.0,
               log_calls: bool = False, node_size: int | None = None) -> None:
    """Join the NVSHMEM job of all JAX processes and allocate the symmetric buffer.

    Collective: every process calls it with the same arguments. The processes compare their
    buffer sizes and ``SHARED_VARIABLES`` (as they are set now: keep them unchanged
    afterwards) through the key-value store before NVSHMEM starts; a difference, or a bad
    size on any process, raises ValueError on every process (it would otherwise hang or
    corrupt). A second call with the same or a smaller size does nothing (but set a config
    it passes).

    Args:
      buffer_bytes: symmetric buffer per GPU. If None and ``num_tokens``/``hidden``/``num_topk``
        /``num_experts`` are given, the size a dispatch + combine of those per-GPU shapes
        needs (``capacity``, ``dtype`` (bf16), ``layout``, ``fp8`` and ``alignment`` refine it);
        otherwise
        ``default_buffer_bytes()``.
      low_latency_bytes: the second symmetric buffer, used only by the low-latency (decode)
        calls; None: ``JAX_EP_LL_BUFFER_BYTES``, else 0 (no low-latency buffer). See
        ``jax_ep.low_latency_buffer_size_hint``.
      config: a ``jax_ep.Config`` for every call of this process that leaves a field None
        (compared across processes like the sizes).
      init_timeout_s: how long to wait for the other processes' posts in jax.distributed's
        key-value store.
      fault_exit_s: after a kernel timed out (its context is then unusable and tearing it
        down can hang), the process exits with status 70 this long after reporting it; 0:
        never.
      log_calls: a diagnostic: one stderr line per custom-call execution, with XLA's run id
        and stream.
      node_size: None: a node is a host (from the host names the processes publish); an int:
        virtual nodes of that many consecutive ranks, to test node-bound jobs on one host.
        The kernels map the PEs of their node only; a call whose EP group leaves the node
        reaches the other nodes by NVSHMEM puts (the normal mode through its node exchange,
        ``jax_ep._cuda``; the low-latency calls directly).
    """
    global _generation, _atexit_registered
    import jax

    module = _module()
    local = jax.local_devices()
    if not local or local[0].platform != "gpu":
        raise RuntimeError("jax_ep.runtime.initialize needs JAX's GPU backend; this process "
                           f"has {[d.platform for d in local]} devices")
    if len(local) != 1:
        raise RuntimeError(
            f"this process owns {len(local)} GPUs, but jax_ep runs one process per GPU: start "
            "the script with `python -m jax_ep.launch -n <gpus> script.py` and call "
            "jax_ep.launch.init_distributed(), or pass local_device_ids=[<gpu>] to "
            "jax.distributed.initialize")
    rank, world = jax.process_index(), jax.process_count()
    client = _distributed_client()
    if client is None and world > 1:
        raise RuntimeError("call jax.distributed.initialize(...) (or jax_ep.launch."
                           "init_distributed()) before jax_ep.runtime.initialize()")

    if config is not None and not isinstance(config, _config.Config):
        raise TypeError(f"config must be a jax_ep.Config or None, got {type(config).__name__}")
    error = None
    try:
        buffer_bytes, low_latency_bytes = _requested_sizes(
            world, buffer_bytes, low_latency_bytes, num_tokens, hidden, num_topk, num_experts,
            capacity, dtype, layout, fp8, alignment)
    except (ValueError, TypeError) as e:
        if module.is_initialized() or world == 1:
            raise
        # the others are about to wait for this process: they get its error, not a timeout
        buffer_bytes, low_latency_bytes, error = 0, 0, f"{type(e).__name__}: {e}"

    if module.is_initialized():
        # checks sizes and rank
        module.initialize(rank, world, 0, buffer_bytes, b"", True, low_latency_bytes)
        if config is not None:  # a repeated call without one keeps the process's
            _config.set_process_config(config)
        return

    generation = _generation
    _generation += 1
    settings = _shared_settings(buffer_bytes, low_latency_bytes, config, node_size)
    if error is not None:
        settings["error"] = error
    hosts = _agree(client, rank, world, generation, settings, init_timeout_s)
    nodes = nodes_of(hosts, node_size)  # the same on every process: they raise alike
    single_host = len(set(hosts)) == 1
    _config.set_process_config(config)
    # NVSHMEM reads these when the unique id is made (its bootstrap socket) and at init.
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if single_host:
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")

    key = f"{_KEY_PREFIX}/{generation}/nvshmem_unique_id"
    if rank == 0:
        unique_id = module.create_unique_id()
        if world > 1:
            client.key_value_set_bytes(key, unique_id)
    else:
        unique_id = client.blocking_key_value_get_bytes(key, int(init_timeout_s * 1000))

    device = local[0].local_hardware_id
    module.initialize(rank, world, int(device if device is not None else 0), buffer_bytes,
                      unique_id, single_host, low_latency_bytes, nodes)
    global _topology
    _topology = Topology(nodes=tuple(nodes), virtual=node_size is not None)
    global _xla_windows_open
    _xla_windows_open = _map_xla_windows(module, client, rank, world, generation, local[0],
                                         nodes, init_timeout_s)
    if _xla_windows_open and os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        warnings.warn(
            "XLA_PYTHON_CLIENT_ALLOCATOR=platform gives every array an allocation of its own, so "
            "the peers' windows into XLA's memory hold none of the calls' arrays and every "
            "normal-mode call stages its transfers (slower; docs/design.md, section 5.4). XLA's "
            "default allocator keeps its arrays in the mapped region.", stacklevel=2)
    module.set_diagnostics(float(fault_exit_s), bool(log_calls))
    _native.register(force=True)
    if not _atexit_registered:
        atexit.register(_finalize_at_exit)
        _atexit_registered = True


def xla_windows_open() -> bool:
    """Whether this job's processes reach each other's XLA arrays directly (the combine's
    reads and the dispatch's stores skip the staged copies), as ``initialize`` set up."""
    return _xla_windows_open


def xla_window_holds(array) -> bool:
    """Whether every shard of ``array`` on this process lies in the allocation of XLA's memory
    that this process's peers map, so that they reach it in place; a call's array outside it
    takes the staged transfers. Under XLA's platform allocator no array does."""
    base, size = _xla_window
    if not _xla_windows_open or size == 0:
        return False
    for shard in array.addressable_shards:
        start = shard.data.unsafe_buffer_pointer()
        if not base <= start <= start + shard.data.nbytes <= base + size:
            return False
    return True


def _map_xla_windows(module, client, rank, world, generation, device, nodes,
                     timeout_s) -> bool:
    """Maps every process's allocation of XLA's device memory into the other processes of its
    node, so that peers read and write arrays where XLA keeps them instead of through staged
    copies (docs/design.md, section 5.4). Returns whether the windows are open."""
    import jax
    import jax.numpy as jnp

    probe = jax.device_put(jnp.zeros((1,), jnp.int32), device).block_until_ready()
    fd, base, size = module.export_xla_window(int(probe.unsafe_buffer_pointer()))
    global _xla_window
    try:
        opened = _open_xla_windows(module, client, rank, world, generation, (fd, base, size),
                                   nodes, timeout_s)
        _xla_window = (int(base), int(size)) if opened else (0, 0)
        return opened
    finally:
        if fd >= 0:
            os.close(fd)


def _open_xla_windows(module, client, rank, world, generation, post, nodes,
                      timeout_s) -> bool:
    """Every process posts the base and size of its XLA allocation and whether it could export
    it (``post``: descriptor or -1, base, size), passes the descriptor to the other processes
    of its node over a Unix socket, and maps theirs. All or nothing: where any process cannot
    export or map, every process ends with no window and the kernels stage as before. Returns
    whether the windows are open."""
    fd, base, size = post
    if world == 1:
        module.open_xla_windows([fd], [base], [size])
        return fd >= 0
    prefix = f"{_KEY_PREFIX}/{generation}/xla_window"
    wait_ms = int(timeout_s * 1000)
    peers = [r for r in range(world) if r != rank and nodes[r] == nodes[rank]]
    name = f"jax_ep-{os.getpid()}-{os.urandom(8).hex()}"
    listener = None
    if fd >= 0 and peers:
        try:
            listener = _listen(name, len(peers))
        except OSError:
            fd = -1
    received: dict[int, int] = {}
    try:
        client.key_value_set_bytes(f"{prefix}/{rank}",
                                   np.array([base, size, fd >= 0], np.uint64).tobytes()
                                   + name.encode())
        posts = [client.blocking_key_value_get_bytes(f"{prefix}/{r}", wait_ms)
                 for r in range(world)]
        ranges = [np.frombuffer(p[:24], np.uint64) for p in posts]
        opened = all(int(r[2]) for r in ranges)
        if opened:  # every process says whether its sends went through before any receives
            sent = _send_descriptor(fd, rank, peers, {r: posts[r][24:].decode() for r in peers},
                                    timeout_s)
            client.key_value_set_bytes(f"{prefix}/sent/{rank}", b"1" if sent else b"0")
            opened = all(client.blocking_key_value_get_bytes(f"{prefix}/sent/{r}", wait_ms)
                         == b"1" for r in range(world))
        if opened:
            try:
                received = _receive_descriptors(listener, peers, timeout_s)
                module.open_xla_windows([fd if r == rank else received.get(r, -1)
                                         for r in range(world)],
                                        [int(r[0]) for r in ranges], [int(r[1]) for r in ranges])
            except (OSError, RuntimeError):
                opened = False
    finally:
        if listener is not None:
            listener.close()
        for received_fd in received.values():
            os.close(received_fd)
    client.key_value_set_bytes(f"{prefix}/opened/{rank}", b"1" if opened else b"0")
    agreed = all(client.blocking_key_value_get_bytes(f"{prefix}/opened/{r}", wait_ms) == b"1"
                 for r in range(world))
    if opened and not agreed:  # a peer could not: close ours too, nobody reads unstaged
        module.open_xla_windows([-1] * world, [0] * world, [0] * world)
    return agreed


def _listen(name: str, backlog: int) -> socket.socket:
    """A Unix socket in the abstract namespace (no file to clean up) that peers connect to."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


def _send_descriptor(fd, rank, peers, names, timeout_s) -> bool:
    """Sends ``fd`` to every peer's listener (``names[peer]``); whether every send went
    through. A send does not wait for the peer to accept (its listener's backlog holds it)."""
    try:
        for peer in peers:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout_s)
                conn.connect("\0" + names[peer])
                socket.send_fds(conn, [rank.to_bytes(4, "little")], [fd])
    except OSError:  # e.g. processes of one host in different network namespaces
        return False
    return True


def _receive_descriptors(listener, peers, timeout_s) -> dict[int, int]:
    """One descriptor from each peer on ``listener`` (every peer has sent it already):
    {peer: descriptor}, owned by the caller."""
    received: dict[int, int] = {}
    if not peers:
        return received
    try:
        listener.settimeout(timeout_s)
        while len(received) < len(peers):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(timeout_s)
                message, fds, _, _ = socket.recv_fds(conn, 4, 1)
                sender = int.from_bytes(message, "little")
                if len(fds) != 1 or sender not in peers or sender in received:
                    for stray in fds:
                        os.close(stray)
                    raise OSError(f"an unexpected descriptor message from {sender}")
                received[sender] = fds[0]
    except BaseException:
        for received_fd in received.values():
            os.close(received_fd)
        raise
    return received


@dataclasses.dataclass(frozen=True)
class Topology:
    """The job's nodes as ``initialize`` found them: ``nodes[r]`` is rank r's node (a host, or
    a virtual node of ``node_size`` ranks). The kernels reach the PEs of their own node."""

    nodes: tuple[int, ...]
    virtual: bool = False

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))


_topology: Topology | None = None


def topology() -> Topology | None:
    """The nodes of the running job (None before ``initialize``)."""
    return _topology


def finalize() -> None:
    """Free the symmetric buffer and end NVSHMEM if ``initialize`` started it.

    Collective (every process calls it); idempotent. Runs at exit by itself.
    """
    global _topology, _xla_windows_open, _xla_window
    module, _ = _native.load()
    if module is not None and module.is_initialized():
        module.finalize()
    _topology, _xla_windows_open, _xla_window = None, False, (0, 0)


def _finalize_at_exit() -> None:
    # finalize() waits for every process: after an uncaught exception the others may never
    # arrive, and a hang at exit would keep the launcher from noticing the failure.
    if getattr(sys, "last_value", None) is not None or not is_initialized():
        return
    done = threading.Event()

    def run():
        try:
            finalize()
        finally:
            done.set()

    threading.Thread(target=run, name="jax_ep-finalize", daemon=True).start()
    if not done.wait(FINALIZE_AT_EXIT_TIMEOUT_S):
        sys.stderr.write(f"jax_ep: finalize did not complete in {FINALIZE_AT_EXIT_TIMEOUT_S:.0f} s "
                         "(another process did not reach it); exiting without it\n")
        sys.stderr.flush()
        os._exit(1)
