"""The collective transport: route rows to the rank owning their expert, and bring the outputs back.

Layout shared by both transports (``"collective"``: `jax.lax.all_to_all`; ``"ragged"``: `jax.lax.ragged_all_to_all`):
this rank's ``n = B k`` routes (route ``t k + j`` = token t, slot j) are packed by destination rank into a send
buffer of ``R`` chunks of ``C`` rows (C = the capacity per peer). Chunk ``d`` holds, in route order, the routes whose
expert lives on rank d. After the exchange, chunk ``s`` of the receive buffer holds the rows rank s sent here, at
the same positions, so the return leg is the same exchange in reverse and every route finds its output at the
slot it was sent from. A row carries its activations (BF16), its local expert id and its route weight, packed
into one uint16 row so that one collective moves all three (an integer type: no float canonicalization can touch
the id and weight bits).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

TRANSPORTS = ("collective", "ragged")
_META = 4  # uint16 columns after the H activation columns: local id (int32) and route weight (float32).


class Layout(NamedTuple):
  """Where each of this rank's routes goes (all arrays over the ``n = B k`` routes, route ``t k + j``)."""

  slot: jax.Array  # int32 [n]: row in the [R C] send buffer, or R C (out of range) when the route is not sent
  sent: jax.Array  # bool [n]: the route is sent (valid id and within capacity)
  overflow: jax.Array  # bool [n]: a valid route that did not fit in its peer's C rows
  invalid: jax.Array  # bool [n]: id >= E (a user error; the token is poisoned, never silently dropped)
  send_sizes: jax.Array  # int32 [R]: rows sent to each peer (<= C)
  peer_load: jax.Array  # int32 [R]: routes for each peer before capacity (the capacity a peer would need)


def layout(ids: jax.Array, num_local: int, num_ranks: int, capacity: int) -> Layout:
  """Assigns every route of ``ids`` (global expert ids ``[B, k]``) a send slot: rank ``id // L``, in route order."""
  flat = ids.reshape(-1).astype(jnp.int32)
  e = num_local * num_ranks
  valid = (flat >= 0) & (flat < e)
  dest = jnp.where(valid, flat // num_local, num_ranks)  # num_ranks: no destination (padding or invalid)
  onehot = (dest[:, None] == jnp.arange(num_ranks, dtype=jnp.int32)).astype(jnp.int32)  # [n, R]
  # Position of a route among the earlier routes to the same peer: keeps each chunk in route order.
  pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
  sent = valid & (pos < capacity)
  slot = jnp.where(sent, dest * capacity + pos, num_ranks * capacity)
  load = jnp.sum(onehot, axis=0)
  return Layout(slot, sent, valid & ~sent, flat >= e, jnp.minimum(load, capacity), load)


def pack(x_rows: jax.Array, local_ids: jax.Array, weights: jax.Array) -> jax.Array:
  """``[n, H]`` bf16, ``[n]`` int32, ``[n]`` f32 -> uint16 ``[n, H + 4]``."""
  bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)
  meta = jnp.concatenate([bits(local_ids.astype(jnp.int32)), bits(weights.astype(jnp.float32))], axis=-1)
  return jnp.concatenate([bits(x_rows.astype(jnp.bfloat16)), meta], axis=-1)


def unpack(rows: jax.Array, hidden: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Inverse of `pack`."""
  x = jax.lax.bitcast_convert_type(rows[:, :hidden], jnp.bfloat16)
  ids = jax.lax.bitcast_convert_type(rows[:, hidden:hidden + 2].reshape(-1, 2), jnp.int32)
  weights = jax.lax.bitcast_convert_type(rows[:, hidden + 2:hidden + 4].reshape(-1, 2), jnp.float32)
  return x, ids, weights


def empty_rows(num_rows: int, hidden: int) -> jax.Array:
  """Packed rows that read as padding (activations 0, local id -1, weight 0)."""
  return pack(jnp.zeros((num_rows, hidden), jnp.bfloat16), jnp.full((num_rows,), -1, jnp.int32),
              jnp.zeros((num_rows,), jnp.float32))


def send_buffer(x: jax.Array, ids: jax.Array, weights: jax.Array, lay: Layout, num_local: int, num_ranks: int,
                capacity: int) -> jax.Array:
  """The packed ``[R C, H + 4]`` send buffer of this rank's routes (rows not sent stay padding)."""
  k = ids.shape[1]
  h = x.shape[1]
  rows = pack(jnp.repeat(x, k, axis=0), ids.reshape(-1) % num_local, weights.reshape(-1))
  # Slot R C is out of range: `mode="drop"` discards exactly the routes that are not sent.
  return empty_rows(num_ranks * capacity, h).at[lay.slot].set(rows, mode="drop")


def exchange(buf: jax.Array, *, axis_name: str, num_ranks: int, capacity: int, transport: str,
             send_sizes: jax.Array, recv_sizes: jax.Array, fill: jax.Array) -> jax.Array:
  """Chunk d of ``buf`` ([R C, W]) to rank d; returns the [R C, W] buffer whose chunk s came from rank s.

  ``send_sizes``/``recv_sizes`` (int32 [R]) are the valid rows per chunk. all_to_all moves all C rows of every
  chunk and ignores them; ragged_all_to_all moves only the valid rows into ``fill`` (what the other rows read).
  """
  if transport == "collective":
    return jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)
  me = jax.lax.axis_index(axis_name).astype(jnp.int32)
  starts = jnp.arange(num_ranks, dtype=jnp.int32) * capacity
  # Fixed strides on both sides: chunk d of the sender lands at chunk `me` of the receiver d.
  return jax.lax.ragged_all_to_all(buf, fill, starts, send_sizes, jnp.full((num_ranks,), me * capacity, jnp.int32),
                                   recv_sizes, axis_name=axis_name)
