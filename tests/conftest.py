"""CPU tests run on 8 fake host devices; the flags must be set before jax is imported.

Under ``python -m jax_ep.launch`` (the GPU suite) each process keeps its own GPU instead; on the
CPU (``JAX_PLATFORMS=cpu``) the processes join one job of their host devices. When
processes share GPUs (``--gpus``), each also gets as many host devices as there are ranks: the
reference backend runs there, since its collectives cannot run over NCCL on a shared GPU.
"""

import os

if "JAX_EP_RANK" not in os.environ:
    os.environ.setdefault("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
elif os.environ.get("JAX_PLATFORMS") == "cpu":
    # the launcher on the CPU (tests/test_launch.py runs CPU tests so): every process's host
    # devices in one jax.distributed job, so that the tests' meshes span the processes
    from jax_ep import launch

    launch.init_distributed()
elif os.environ.get("JAX_EP_SHARED_GPUS") == "1":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{os.environ['JAX_EP_WORLD_SIZE']}")


def pytest_report_header(config):
    """Which CUDA extension the tests run, and whether it was built from this checkout."""
    from jax_ep import _native

    return _native.build_line()
