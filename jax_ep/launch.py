"""Start one process per local GPU: ``python -m jax_ep.launch -n N script.py [args...]``.

Each process gets ``JAX_EP_RANK`` (global process index), ``JAX_EP_WORLD_SIZE``,
``JAX_EP_LOCAL_RANK`` and ``JAX_EP_LOCAL_DEVICE`` (its GPU among the visible ones; the launcher
leaves ``CUDA_VISIBLE_DEVICES`` alone) and ``JAX_EP_COORDINATOR`` (host:port of
jax.distributed's coordinator, by default 127.0.0.1 and a free port). The script calls
``jax_ep.launch.init_distributed()``, which runs ``jax.distributed.initialize`` with
``local_device_ids=[JAX_EP_LOCAL_DEVICE]`` and does nothing when the script was not launched.

Output lines are prefixed with ``[rank k] ``. If a process exits with an error, the others are
stopped and the launcher exits with that process's status. Ctrl-C is forwarded to every
process (a second one kills them); SIGTERM too, followed by SIGKILL for ranks still running
after a grace period (jax.distributed's preemption notifier keeps a rank alive on SIGTERM).
``script.py`` may also be ``-m module [args]``, e.g.
``python -m jax_ep.launch -n 2 -m pytest -q tests/test_gpu.py``.

Several hosts: run the launcher once per host with the same ``--coordinator host:port`` (an
address of the first host, reachable from the others), ``--num-processes`` (processes of all
hosts) and this host's ``--process-id-offset`` (processes on the hosts before it). Under SLURM,
with one task per node and 8 GPUs per node::

    srun --ntasks-per-node=1 bash -c 'python -m jax_ep.launch -n 8 \\
        --coordinator "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):29400" \\
        --num-processes $((8 * SLURM_NNODES)) --process-id-offset $((8 * SLURM_NODEID)) \\
        train.py'

(jax_ep's normal-mode kernels reach the GPUs of their own host only so far: put their
expert-parallel axis inside a host and the other mesh axes across hosts; the low-latency calls
cross hosts. On one machine, two invocations form such a job too, each on its own GPUs:
``--first-gpu``.)

``--gpus G`` with G below ``-n`` puts several processes on one GPU (process k on GPU k mod G),
to test multi-rank logic on a smaller machine: NVSHMEM then runs several PEs per GPU, and their
kernels take turns (time slices), so it is slow and says nothing about speed. NCCL refuses two
ranks on one GPU, so XLA's collectives fail there; the launcher sets ``JAX_EP_SHARED_GPUS=1``
so that a script can avoid them, and turns XLA's memory preallocation off.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

_STOP_GRACE_S = 10.0


def _local_gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    # jax.distributed's coordinator listens on every address, IPv4 and IPv6
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family)
        except OSError:  # no IPv6 here
            continue
        with s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _free_port() -> int:
    """A port for the coordinator, free now and outside the ephemeral range: a port the kernel
    gave to bind(0) is one it may hand to any outgoing connection (the ranks' own, another
    job's) before rank 0's coordinator binds it, and that rank then fails to start."""
    low, high = _ephemeral_ports()
    rng = random.Random()
    if low > 10_000:  # registered ports below the range
        for _ in range(200):
            port = rng.randrange(10_000, low)
            if _bindable(port):
                return port
    elif high < 65_000:  # the range set low: above it
        for _ in range(200):
            port = rng.randrange(high + 1, 65_536)
            if _bindable(port):
                return port
    with socket.socket() as s:  # no room outside the range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uses_gpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return not platforms or any(p in platforms for p in ("cuda", "gpu", "rocm"))


def init_distributed() -> bool:
    """``jax.distributed.initialize`` from the launcher's variables; False when not launched.

    Called again in the same process (a script and a library it imports), it does nothing.
    On the CPU the processes' host devices form one job (``JAX_NUM_CPU_DEVICES`` a process),
    their collectives over Gloo: a multi-host script runs as it would across hosts.
    """
    if "JAX_EP_RANK" not in os.environ:
        return False
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return True
    kwargs = {}
    if _uses_gpu():
        device = os.environ.get("JAX_EP_LOCAL_DEVICE", os.environ.get("JAX_EP_LOCAL_RANK", "0"))
        kwargs["local_device_ids"] = [int(device)]
    elif getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # older jax: none
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_EP_COORDINATOR"],
        num_processes=int(os.environ["JAX_EP_WORLD_SIZE"]),
        process_id=int(os.environ["JAX_EP_RANK"]),
        **kwargs)
    return True


def _signal_note(status: int) -> str:
    """What a rank's death by a signal usually means here."""
    if status >= 0:
        return ""
    try:
        name = signal.Signals(-status).name
    except ValueError:
        return ""
    if name == "SIGABRT":  # XLA aborts on a kernel's trap: a timed-out wait's report precedes it
        return (" (SIGABRT: an abort, e.g. after a kernel's timed-out wait, whose report is in "
                "the rank's output; pytest keeps it only with --capture=sys)")
    return f" ({name})"


def _pump(stream, prefix: str, sink, lock: threading.Lock) -> None:
    writing = True
    for line in iter(stream.readline, b""):
        if not writing:
            continue  # drained all the same: a rank blocked on a full pipe would never end
        text = line.decode(errors="replace")
        try:
            with lock:
                sink.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
                sink.flush()
        except (OSError, ValueError):  # our reader went away (`| head`): stop writing
            writing = False
    stream.close()


# Runs first in every rank's process (python -c, so without importing jax): on Linux the
# rank gets SIGKILL when the launcher dies, even by SIGKILL (ranks run in their own sessions,
# out of reach of the launcher's process group), then it becomes the script.
_RANK_START = """
import os, signal, sys
if sys.platform.startswith("linux"):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
if os.getppid() != int(os.environ["JAX_EP_LAUNCHER_PID"]):
    os._exit(1)  # the launcher is already gone
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.launch", description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nproc", type=int, default=None,
                        help="processes on this host (default: its visible GPUs)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to spread this host's processes over (default: one per "
                             "process); fewer than -n shares GPUs, for tests only")
    parser.add_argument("--first-gpu", type=int, default=0,
                        help="this invocation's first GPU (default 0): two invocations on one "
                             "machine, each on its own GPUs, form a job as two hosts would")
    parser.add_argument("--coordinator", default=None,
                        help="host:port of jax.distributed's coordinator (default: 127.0.0.1 "
                             "and a free port)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="processes on all hosts (default: --nproc)")
    parser.add_argument("--process-id-offset", type=int, default=0,
                        help="global rank of this host's first process (default 0)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="script.py [args...] or -m module [args...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a script (or -m module) to run")
    nproc = args.nproc if args.nproc is not None else _local_gpu_count()
    if nproc < 1:
        parser.error("found no GPUs: pass -n")
    world = args.num_processes if args.num_processes is not None else nproc
    if args.process_id_offset < 0 or args.process_id_offset + nproc > world:
        parser.error(f"ranks {args.process_id_offset}..{args.process_id_offset + nproc - 1} do "
                     f"not fit in --num-processes {world}")
    if args.gpus is not None and not 1 <= args.gpus <= nproc:
        parser.error(f"--gpus {args.gpus}: give 1..{nproc} (the processes on this host)")
    if args.first_gpu < 0:
        parser.error(f"--first-gpu {args.first_gpu}: give 0 or more")
    if world > nproc and args.coordinator is None:
        parser.error("several hosts need --coordinator host:port")
    return args, command, nproc, world


def main(argv=None) -> int:
    args, command, nproc, world = _parse(argv)
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    lock = threading.Lock()
    procs, pumps, ranks = [], [], []
    gpus = args.gpus or nproc

    def signal_all(sig):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    interrupts = 0

    def on_interrupt(*_):
        nonlocal interrupts
        interrupts += 1
        signal_all(signal.SIGINT if interrupts == 1 else signal.SIGKILL)

    # jax.distributed's preemption notifier takes SIGTERM in the ranks and lets them run on,
    # so a SIGTERM for the launcher (`timeout`, a job's end) becomes SIGKILL after a grace.
    kill_at = None

    def on_terminate(*_):
        nonlocal kill_at
        signal_all(signal.SIGTERM)
        kill_at = time.monotonic() + _STOP_GRACE_S

    # installed before the first rank starts: a signal during the start reaches those started
    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_terminate)

    status = 0
    try:
        for local_rank in range(nproc):
            rank = args.process_id_offset + local_rank
            env = dict(os.environ, JAX_EP_RANK=str(rank), JAX_EP_WORLD_SIZE=str(world),
                       JAX_EP_LOCAL_RANK=str(local_rank),
                       JAX_EP_LOCAL_DEVICE=str(args.first_gpu + local_rank % gpus),
                       JAX_EP_COORDINATOR=coordinator, JAX_EP_LAUNCHER_PID=str(os.getpid()),
                       PYTHONUNBUFFERED="1",
                       NVSHMEM_DISABLE_NVLS="1")  # multicast stays off, whatever the caller set
            env.setdefault("NCCL_NVLS_ENABLE", "0")
            if gpus < nproc:
                env["JAX_EP_SHARED_GPUS"] = "1"
                env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
            # Own process group each: a signal for one rank reaches its children too.
            proc = subprocess.Popen([sys.executable, "-c", _RANK_START, *command], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)
            ranks.append(rank)
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank}] ",
                                                        sys.stdout, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        while any(p.poll() is None for p in procs):
            if kill_at is not None and time.monotonic() > kill_at:
                with lock:
                    sys.stderr.write("[launch] ranks still running after SIGTERM: killing them\n")
                    sys.stderr.flush()
                signal_all(signal.SIGKILL)
                kill_at = None
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None:
                status = procs[failed].returncode
                with lock:
                    sys.stderr.write(f"[launch] rank {ranks[failed]} exited with {status}"
                                     f"{_signal_note(status)}: stopping the others\n")
                    sys.stderr.flush()
                signal_all(signal.SIGTERM)
                deadline = time.monotonic() + _STOP_GRACE_S
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                signal_all(signal.SIGKILL)
                break
            time.sleep(0.05)
    except BaseException:  # a failed start or an error here: no rank outlives the launcher
        signal_all(signal.SIGKILL)
        raise
    finally:
        for p in procs:
            p.wait()
        for pump in pumps:
            pump.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode != 0), 0)
    return 128 - status if status < 0 else status  # killed by signal N: 128 + N, like a shell


if __name__ == "__main__":
    sys.exit(main())
