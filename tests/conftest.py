"""Shared fixtures: small random problems (never zeros) and the test level."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gcmoe_jax import api, formats
from gcmoe_jax.bench.problems import Shape, make_problem

# Small enough for 2 CPU cores, large enough to cover several K128 blocks, 8-row gate/up groups and k > 1.
SMALL = Shape(experts=8, hidden=512, intermediate=256, top_k=4, tokens=6, shared_intermediate=None)
FULL = os.environ.get("GCMOE_TEST_LEVEL", "quick") == "full"


def quantized(p):
  """(x bf16, ExpertWeights, Routes) of a bench Problem."""
  w = formats.quantize_experts(p.w13, p.w2, shared=p.shared, shared_group=p.shape.shared_group)
  return jnp.asarray(p.x, jnp.bfloat16), w, api.Routes(jnp.asarray(p.ids), jnp.asarray(p.weights))


@pytest.fixture(scope="session")
def small_problem():
  return make_problem("default", SMALL, seed=11)
