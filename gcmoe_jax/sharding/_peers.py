"""Exchanging small per-process byte strings before an expert-parallel job's first replay (issue 9).

The fused transport maps every rank's workspace into every peer: within one process the runtime has the pointers
itself; across processes each rank exports a CUDA IPC handle (a few dozen bytes) that the others must open. Those
bytes travel through `jax.distributed`'s key-value store, outside any jitted program and graph capture, once per
workspace. Waits are bounded: a process that never publishes makes the others raise naming it, never hang.
"""

from __future__ import annotations

import threading

import jax

from gcmoe_jax import _compat, ffi

__all__ = ["exchange", "release_fused_workspaces"]

_PREFIX = "gcmoe_jax/peers"
_used: set[str] = set()
_lock = threading.Lock()


def exchange(name: str, payload: bytes, *, timeout_ms: int = 60_000) -> list[bytes]:
  """Every process's ``payload`` for ``name``, indexed by `jax.process_index` (this process's included).

  Args:
    name: what is exchanged; unique per exchange in the job (the store keeps its keys), e.g. a layer's workspace
      key. Every process must call with the same ``name``.
    payload: this process's bytes (small: handles, not tensors).
    timeout_ms: how long to wait for each other process's bytes.

  Raises:
    TypeError, ValueError: for a payload that is not bytes, or a name used twice in this process.
    TimeoutError: when a process has not published within ``timeout_ms`` (naming it).
  """
  if not isinstance(payload, (bytes, bytearray)):
    raise TypeError(f"exchange: payload must be bytes, got {type(payload).__name__}")
  if not isinstance(name, str) or not name or "/" in name:
    raise ValueError(f"exchange: name must be a non-empty str without '/', got {name!r}")
  with _lock:
    if name in _used:
      raise ValueError(f"exchange: name {name!r} was already exchanged in this process; names are single-use")
    _used.add(name)
  n, me = jax.process_count(), jax.process_index()
  if n == 1:
    return [bytes(payload)]
  client = _compat.distributed_client()
  if client is None:
    raise RuntimeError(f"exchange: {n} processes but no jax.distributed client (call jax.distributed.initialize)")
  client.key_value_set_bytes(f"{_PREFIX}/{name}/{me}", bytes(payload))
  out = []
  for p in range(n):
    if p == me:
      out.append(bytes(payload))
      continue
    try:
      out.append(client.blocking_key_value_get_bytes(f"{_PREFIX}/{name}/{p}", timeout_ms))
    except Exception as e:  # the client raises a generic error on expiry (DEADLINE_EXCEEDED)
      if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
        raise
      raise TimeoutError(f"exchange: process {p} did not publish {name!r} within {timeout_ms} ms (this is process "
                         f"{me} of {n})") from e
  return out


def release_fused_workspaces(*, timeout_ms: int = 60_000) -> int:
  """Frees the fused transport's workspaces shared across processes (CUDA IPC); collective: every process of the
  job calls it once the outputs of its last ``transport="fused"`` call are ready (`jax.block_until_ready`: a call
  still queued in jax when the release runs fails). Each process waits for its devices, meets the others (an
  `exchange`, so no peer still reads a workspace when it goes) and releases its ranks' groups: a program traced
  before raises if it runs again (under XLA command buffers a replay may not reach the library, so such programs
  must not run again: drop them), and the memory (this process's workspaces and its mappings of the peers') is
  freed with the last program that holds it, at once after `jax.clear_caches()` unless the caller keeps compiled
  programs alive. A later trace exchanges new workspaces. Groups within one process free with their programs and
  need no call; with one process this only waits for the devices.

  Returns:
    How many groups this process released.

  Raises:
    TimeoutError: a process did not reach the release within ``timeout_ms`` (naming it; nothing was released).
    RuntimeError: the driver's error while waiting for this process's devices.
  """
  return ffi.release_processes(lambda name, payload: exchange(name, payload, timeout_ms=timeout_ms))
