"""Issue 12: hypothesis-driven random shapes within Table 10 and random routing, cpu backend vs the oracle, bit
for bit."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcmoe_jax as gm
from gcmoe_jax import reference


def _cpu_or_skip():
  if not gm.api.backend_support()["cpu"].ok:
    pytest.skip(gm.api.backend_support()["cpu"].reason)


@st.composite
def problems(draw):
  experts = draw(st.integers(1, 8))
  top_k = draw(st.integers(1, min(experts, 4)))
  hidden = draw(st.sampled_from([512, 640]))
  inter = draw(st.sampled_from([256, 384]))
  tokens = draw(st.integers(0, 5))
  shared = draw(st.sampled_from([None, 32, 128]))
  clamp = draw(st.sampled_from([None, 0.75, 7.0]))
  seed = draw(st.integers(0, 2**31 - 1))
  return experts, top_k, hidden, inter, tokens, shared, clamp, seed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_cpu_backend_equals_the_oracle_on_random_problems(p):
  _cpu_or_skip()
  experts, top_k, hidden, inter, tokens, shared, clamp, seed = p
  rng = np.random.default_rng(seed)
  w13 = jnp.asarray(rng.standard_normal((experts, hidden, 2 * inter)) / np.sqrt(hidden), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((experts, inter, hidden)) / np.sqrt(inter), jnp.float32)
  sh = None
  if shared is not None:
    sh = (jnp.asarray(rng.standard_normal((hidden, 512)) / np.sqrt(hidden), jnp.float32),
          jnp.asarray(rng.standard_normal((256, hidden)) / np.sqrt(256), jnp.float32))
  w = gm.quantize_experts(w13, w2, shared=sh, shared_group=shared or 128)
  # Activations spanning many binades (so blocks scale differently), padding (-1) and duplicate routes.
  x = jnp.asarray(rng.standard_normal((tokens, hidden)) * np.exp2(rng.integers(-8, 8, (tokens, 1))), jnp.bfloat16)
  ids = jnp.asarray(rng.integers(-1, experts, (tokens, top_k)), jnp.int32)
  rw = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
  y = gm.moe(x, w, gm.Routes(ids, rw), clamp=clamp, backend="cpu")
  want = reference.moe_emulated(x, w, ids, rw, clamp=clamp)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np.asarray(want).view(np.uint16))
