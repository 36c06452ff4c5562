"""Start one process per local GPU: ``python -m jax_ep.launch -n N script.py [args...]``.

Each process gets ``JAX_EP_RANK``, ``JAX_EP_WORLD_SIZE``, ``JAX_EP_LOCAL_RANK`` and
``JAX_EP_COORDINATOR``; the script calls ``jax_ep.launch.init_distributed()``, which runs
``jax.distributed.initialize`` with ``local_device_ids=[local rank]`` (it does nothing when the
script was not launched). Output lines are prefixed with ``[rank k]``. If any process exits
with an error, the others are stopped and the launcher exits with that status.

``script.py`` may also be ``-m module`` (e.g. ``-m pytest tests/test_gpu_dispatch.py``).

Several hosts: run the launcher once per host with the same ``--coordinator host:port`` (an
address of the first host), ``--num-processes`` (all GPUs of all hosts) and this host's
``--process-id-offset`` (sum of GPUs on the hosts before it). Under SLURM, for example::

    srun --ntasks-per-node=1 bash -c 'python -m jax_ep.launch -n 8 \\
        --coordinator "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):29400" \\
        --num-processes $((8 * SLURM_NNODES)) --process-id-offset $((8 * SLURM_NODEID)) \\
        train.py'
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def _local_gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> bool:
    """``jax.distributed.initialize`` from the launcher's variables; False if not launched."""
    if "JAX_EP_RANK" not in os.environ:
        return False
    import jax

    local_rank = int(os.environ["JAX_EP_LOCAL_RANK"])
    kwargs = {}
    if os.environ.get("JAX_PLATFORMS", "") != "cpu":
        kwargs["local_device_ids"] = [local_rank]
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_EP_COORDINATOR"],
        num_processes=int(os.environ["JAX_EP_WORLD_SIZE"]),
        process_id=int(os.environ["JAX_EP_RANK"]),
        **kwargs)
    return True


def _pump(stream, prefix, sink, lock):
    for line in iter(stream.readline, b""):
        with lock:
            sink.write(prefix + line.decode(errors="replace"))
            sink.flush()
    stream.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.launch", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nproc", type=int, default=None,
                        help="processes on this host (default: its visible GPUs)")
    parser.add_argument("--coordinator", default=None,
                        help="host:port of jax.distributed's coordinator (default: loopback)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="processes on all hosts (default: --nproc)")
    parser.add_argument("--process-id-offset", type=int, default=0,
                        help="global rank of this host's first process")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="script.py [args] or -m module [args]")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give a script (or -m module) to run")
    nproc = args.nproc if args.nproc is not None else _local_gpu_count()
    if nproc < 1:
        parser.error("no GPUs found: pass -n")
    world = args.num_processes or nproc
    coordinator = args.coordinator or f"127.0.0.1:{_free_port()}"
    command = args.command[1:] if args.command[0] == "--" else args.command
    lock = threading.Lock()
    procs, pumps = [], []
    for local_rank in range(nproc):
        rank = args.process_id_offset + local_rank
        env = dict(os.environ,
                   JAX_EP_RANK=str(rank), JAX_EP_WORLD_SIZE=str(world),
                   JAX_EP_LOCAL_RANK=str(local_rank), JAX_EP_COORDINATOR=coordinator,
                   PYTHONUNBUFFERED="1", NVSHMEM_DISABLE_NVLS="1")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")
        proc = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank}] ",
                                                    sys.stdout, lock), daemon=True)
        pump.start()
        pumps.append(pump)

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGINT, lambda *_: stop_all(signal.SIGINT))
    signal.signal(signal.SIGTERM, lambda *_: stop_all())
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                with lock:
                    sys.stderr.write(f"[launch] rank {procs.index(failed[0])} exited with "
                                     f"{status}: stopping the others\n")
                stop_all()
                deadline = time.time() + 10
                while time.time() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                stop_all(signal.SIGKILL)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode != 0), 0)
    return 1 if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
