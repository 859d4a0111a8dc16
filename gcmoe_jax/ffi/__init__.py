"""The XLA FFI primitive (placeholder until the C++ library lands: every platform reports unavailable)."""

from __future__ import annotations

from gcmoe_jax._support import Support


def platform_support(platform: str) -> Support:
  """Whether the FFI handler for ``platform`` ("cpu" or "cuda") is built and registered."""
  return Support(False, f"the gcmoe_jax FFI library is not built yet (no {platform} handler)")


def moe_call(x, w, ids, weights, *, clamp):
  raise RuntimeError("gcmoe_jax FFI library is not built")
