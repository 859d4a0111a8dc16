"""Shared fixtures: small random problems (never zeros) and the test level."""

import os

import jax

# Eight CPU devices for the expert-parallel tests (the default device stays cpu:0). Must run before any backend
# initialises; conftest.py is imported first.
if "jax_num_cpu_devices" in jax.config.values:
  jax.config.update("jax_num_cpu_devices", 8)
else:  # pragma: no cover - older jax
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax.numpy as jnp
import pytest

from gcmoe_jax import _config, api, formats
from gcmoe_jax.bench.problems import Shape, make_problem

# Small enough for 2 CPU cores, large enough to cover several K128 blocks, 8-row gate/up groups and k > 1.
SMALL = Shape(experts=8, hidden=512, intermediate=256, top_k=4, tokens=6, shared_intermediate=None)
FULL = _config.get("GCMOE_TEST_LEVEL") == "full"  # (a misspelt level raises instead of meaning quick)


def quantized(p):
  """(x bf16, ExpertWeights, Routes) of a bench Problem."""
  w = formats.quantize_experts(p.w13, p.w2, shared=p.shared, shared_group=p.shape.shared_group)
  return jnp.asarray(p.x, jnp.bfloat16), w, api.Routes(jnp.asarray(p.ids), jnp.asarray(p.weights))


@pytest.fixture(scope="session")
def small_problem():
  return make_problem("default", SMALL, seed=11)
