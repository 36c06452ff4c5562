"""Can a peer process write into XLA's own buffers? ``python -m jax_ep.launch -n 2
benchmarks/xla_buffer_probe.py [--mib 1024]`` on a machine with one GPU per process.

The normal-mode paths copy twice because XLA owns their inputs and outputs: the dispatch pushes
rows into the receiver's symmetric buffer and the receiver copies them into its output; the
pull combine first stages the rows of y that peers need. If each process could map its peers'
XLA allocations once, a sender could store straight into the receiver's output and an owner
could read y straight from the expert rank. This probe checks, through the CUDA driver API:

1. which allocation a JAX array lives in (its range, whether legacy IPC can export it, the
   handle types it allows), and whether arrays made later share that allocation;
2. that the peer maps it (``cuIpcOpenMemHandle``) and that its writes there show up in the
   owner's JAX array;
3. the copy engines' rate into the peer's mapped array, both directions busy.

It prints one line per check on rank 0 and exits non-zero where a check fails.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.launch import init_distributed

CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class Driver:
    """The few driver calls the probe needs; every call checked."""

    def __init__(self, ordinal: int):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check("cuInit", 0)
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check("cuDeviceGet", ctypes.byref(device), ordinal)
        # XLA runs in the device's primary context: make it current on this thread.
        self._check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
        self._check("cuCtxSetCurrent", ctx)
        # CUDA 13's cuda.h maps cuEventElapsedTime to its _v2; older drivers lack the _v2.
        self._elapsed = ("cuEventElapsedTime_v2" if hasattr(self.lib, "cuEventElapsedTime_v2")
                         else "cuEventElapsedTime")

    def _check(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{name}: CUDA error {rc} ({(text.value or b'?').decode()})")

    def try_call(self, name, *args) -> int:
        return getattr(self.lib, name)(*args)

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size),
                    ctypes.c_uint64(ptr))
        return base.value, size.value

    def attribute(self, attr: int, ptr: int) -> int:
        value = ctypes.c_uint64(0)
        rc = self.try_call("cuPointerGetAttribute", ctypes.byref(value), attr,
                           ctypes.c_uint64(ptr))
        return value.value if rc == 0 else -rc

    def ipc_handle(self, base: int) -> bytes | None:
        handle = IpcHandle()
        rc = self.try_call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(base))
        return bytes(handle.reserved) if rc == 0 else None

    def ipc_open(self, raw: bytes) -> int:
        handle = IpcHandle()
        ctypes.memmove(handle.reserved, raw, 64)
        ptr = ctypes.c_uint64()
        self._check("cuIpcOpenMemHandle_v2", ctypes.byref(ptr), handle,
                    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return ptr.value

    def ipc_close(self, ptr: int):
        self._check("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    def memset32(self, ptr: int, value: int, count: int):
        self._check("cuMemsetD32_v2", ctypes.c_uint64(ptr), ctypes.c_uint(value),
                    ctypes.c_size_t(count))
        self._check("cuCtxSynchronize")

    def timed_copy(self, dst: int, src: int, nbytes: int, repeats: int) -> float:
        """Median ms of a device-to-device copy on a fresh stream."""
        stream, start, end = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._check("cuStreamCreate", ctypes.byref(stream), 1)  # non-blocking
        self._check("cuEventCreate", ctypes.byref(start), 0)
        self._check("cuEventCreate", ctypes.byref(end), 0)
        times = []
        for _ in range(repeats):
            self._check("cuEventRecord", start, stream)
            self._check("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_uint64(src),
                        ctypes.c_size_t(nbytes), stream)
            self._check("cuEventRecord", end, stream)
            self._check("cuEventSynchronize", end)
            ms = ctypes.c_float()
            self._check(self._elapsed, ctypes.byref(ms), start, end)
            times.append(ms.value)
        self._check("cuStreamDestroy_v2", stream)
        return float(np.median(times))


def _exchange(key: str, value: bytes, rank: int, world: int) -> list[bytes]:
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set_bytes(f"xla_buffer_probe/{key}/{rank}", value)
    return [client.blocking_key_value_get_bytes(f"xla_buffer_probe/{key}/{r}", 60_000)
            for r in range(world)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the copy-rate arrays")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    init_distributed()
    rank, world = jax.process_index(), jax.process_count()
    if world != 2:
        print("run with two processes: python -m jax_ep.launch -n 2 ...")
        return 2
    peer = 1 - rank
    device = jax.local_devices()[0]
    ordinal = int(os.environ.get("JAX_EP_LOCAL_DEVICE", device.local_hardware_id or 0))
    drv = Driver(ordinal)
    say = print if rank == 0 else (lambda *a, **k: None)
    failed = []

    # 1. The allocation behind a small array, and whether later arrays share it.
    count = 1 << 20
    small = jax.device_put(jnp.zeros((count,), jnp.int32), device).block_until_ready()
    ptr = small.unsafe_buffer_pointer()
    base, size = drv.address_range(ptr)
    legacy = drv.attribute(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr)
    handle_types = drv.attribute(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr)
    words = args.mib << 18  # int32 words
    src = jax.device_put(jnp.full((words,), rank, jnp.int32), device).block_until_ready()
    dst = jax.device_put(jnp.zeros((words,), jnp.int32), device).block_until_ready()
    same = all(drv.address_range(a.unsafe_buffer_pointer())[0] == base for a in (src, dst))
    env = {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_CLIENT")}
    say(f"allocation: {size / 2**30:.2f} GiB at offset {ptr - base} of its range; legacy IPC "
        f"capable {legacy}; allowed handle types {handle_types}; later {args.mib} MiB arrays "
        f"in the same range: {same}; {env or 'XLA_PYTHON_CLIENT_* unset'}")
    raw = drv.ipc_handle(base)
    if raw is None:
        say("cuIpcGetMemHandle refused the allocation: legacy IPC cannot export XLA's buffers")
        return 1

    # 2. The peer maps it and writes into the owner's array.
    offsets = np.array([ptr - base, src.unsafe_buffer_pointer() - base,
                        dst.unsafe_buffer_pointer() - base], np.uint64)
    handles = _exchange("handle", raw + offsets.tobytes(), rank, world)
    peer_base = drv.ipc_open(handles[peer][:64])
    peer_small, _, peer_dst = (peer_base + int(o)
                               for o in np.frombuffer(handles[peer][64:], np.uint64))
    drv.memset32(peer_small, 1000 + rank, count)
    _exchange("written", b"1", rank, world)
    seen = np.asarray(small)
    ok = bool((seen == 1000 + peer).all())
    say(f"peer's writes visible in the owner's JAX array: {ok}")
    if not ok:
        failed.append("visibility")

    # 3. Copy-engine rate into the peer's array, both ranks at once.
    _exchange("copy", b"1", rank, world)
    nbytes = words * 4
    ms = drv.timed_copy(peer_dst, src.unsafe_buffer_pointer(), nbytes, args.repeats)
    rates = _exchange("rate", np.float64(nbytes / ms / 1e6).tobytes(), rank, world)
    gbs = [float(np.frombuffer(r, np.float64)[0]) for r in rates]
    say(f"copy engines into the peer's mapped array, {args.mib} MiB, both directions: "
        + ", ".join(f"rank {r} {g:.1f} GB/s" for r, g in enumerate(gbs)))
    got = np.asarray(dst)
    ok = bool((got == peer).all())
    say(f"copied rows visible in the owner's JAX array: {ok}")
    if not ok:
        failed.append("copy")
    _exchange("done", b"1", rank, world)
    drv.ipc_close(peer_base)
    if failed:
        say("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
