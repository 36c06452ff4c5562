"""CPU tests run on 8 fake host devices; the flag must be set before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", os.environ.get("JAX_EP_TEST_PLATFORMS", "cpu"))
