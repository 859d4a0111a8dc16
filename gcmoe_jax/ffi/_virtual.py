"""The fused expert-parallel transport on ONE GPU with virtual ranks (issue 9, docs/fused_transport.md).

R ranks, each with its own (dispatch, compute) green-context pair of the same GPU, its own workspace and its own
three-role graph; every workspace's peer table points at all R workspaces, so role 1 pulls the rows its L = E/R
experts need from the peers' quantized x and role 2 stores each GEMM2 row straight into its owner's arena, exactly
as across GPUs, where the table would hold peer-mapped addresses. All R graphs are launched at once on R streams.

This is a test and benchmark harness, not the user path (that is `gcmoe_jax.moe(..., axis_name=...,
transport="fused")` over real devices): it takes JAX arrays, hands their device buffers to the C++ runtime through
ctypes and writes each rank's output into a fresh buffer it allocated, outside XLA.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gcmoe_jax import _config, geometry, reference
from gcmoe_jax.ffi import _cuda, _library
from gcmoe_jax.formats import ExpertWeights
from gcmoe_jax.kernels import abi, build

__all__ = ["VirtualRanks"]

# Tests run R = 4 on 132 SMs: 8 + 24 SMs per rank. The eq. 5 floor of 32 compute SMs protects speed, not
# correctness (geometry.split_virtual_ranks).
MIN_COMPUTE_SMS = 16


def _lib():
  lib = _library.library()
  if lib is None:
    raise RuntimeError(f"gcmoe_jax FFI: {_library.library_info().error}")
  return lib


def _ptr(a: jax.Array) -> int:
  return int(a.unsafe_buffer_pointer())


class VirtualRanks:
  """R virtual ranks of one MoE layer on one GPU, connected by the fused transport.

  Rank r holds the experts ``r L .. r L + L - 1`` (L = E / R) of ``w`` and ``tokens[r]`` tokens; ids are global.
  Calling it runs one step on every rank at once and returns each rank's outputs, which must equal
  `reference.moe_emulated` of the concatenated tokens on the whole layer.

  Args:
    w: the whole layer (E experts, the shared expert replicated on every rank if present).
    top_k: k.
    ranks: R in [2, 16]; E must be a multiple of R.
    capacity: tokens one rank may hold (sizes the variant and its workspaces).
    tokens: T of each rank (0 allowed: the rank still takes part).
    clamp: the SwiGLU clamp, or None.
    relay: the relay return path (copier CTAs; paper §4.6) instead of the direct one.
    dispatch_sms: the dispatch SMs requested per rank (default: the device's).
    min_compute_sms: the smallest compute partition accepted per rank.
    device: the CUDA device ordinal.

  Raises:
    ValueError: for arguments out of range or a split that does not fit the device.
    RuntimeError: when the CUDA backend or the runtime cannot run it.
  """

  def __init__(self, w: ExpertWeights, *, top_k: int, ranks: int, capacity: int, tokens: Sequence[int],
               clamp: float | None = None, relay: bool = False, dispatch_sms: int | None = None,
               min_compute_sms: int = MIN_COMPUTE_SMS, device: int = 0):
    self._handle = None
    if not isinstance(w, ExpertWeights):
      raise TypeError(f"VirtualRanks: w must be gcmoe_jax.ExpertWeights, got {type(w).__name__}")
    e = w.num_experts
    if not 2 <= ranks <= abi.MAX_RANKS or e % ranks:
      raise ValueError(f"VirtualRanks: ranks must be in [2, {abi.MAX_RANKS}] and divide E = {e}, got {ranks}")
    tokens = [int(t) for t in tokens]
    if len(tokens) != ranks or any(not 0 <= t <= capacity for t in tokens):
      raise ValueError(f"VirtualRanks: tokens must hold {ranks} values in [0, capacity = {capacity}], got {tokens}")
    s = _cuda.device_arch(jax.devices()[device] if device < len(jax.devices()) else None)
    if not s.ok:
      raise RuntimeError(f"VirtualRanks: the CUDA backend cannot run here: {s.reason}")
    arch = s.reason
    facts, _ = _cuda.device_facts(device, arch)
    # The driver's split, not the SM count's: it makes fewer aligned groups than the SM count suggests where
    # clusters are uneven (H200: 15 groups of 8 from 132 SMs, so R = 2 gets 8 + 48, not 8 + 56).
    split, problems = geometry.split_virtual_ranks(facts, ranks, dispatch_sms, min_compute_sms=min_compute_sms,
                                                   groups=self._driver_groups(device, facts.min_partition_sms))
    if problems:
      raise ValueError(f"VirtualRanks: the split does not fit device {device}: " + "; ".join(problems))
    shared = w.shared
    local = e // ranks
    self.variant = build.Variant(w.hidden, w.intermediate, local, top_k, capacity,
                                 shared.intermediate if shared else None, shared.group if shared else None, ranks,
                                 bool(relay))
    built = build.load_or_build(arch, self.variant)
    ws = self.variant.workspace()
    timeout_ns = int(_config.get("GCMOE_WAIT_TIMEOUT_MS")) * 1_000_000
    # The runtime's split (compute 0) takes as many groups per rank as fit, which is this split; the grids follow.
    d, c = split.dispatch_sms, split.compute_sms
    key = f"{build.cache_key(arch, self.variant)}:vr:d{d}:c{c}:t{timeout_ns}"
    # Role 1 spreads its copies over the dispatch partition (`BuiltVariant.dispatch_grid`); roles 2 and 3 as on one
    # rank.
    launch = (built.dispatch_grid(d), *built.launch(1)[1:], *built.launch(2, c), *built.launch(3, c))
    _cuda.register_raw(key, (capacity, d, timeout_ns, _cuda.workspace_bytes(ws), ws.silu_table, 0), launch,
                       [built.cubin(r) for r in (1, 2, 3)], reference.silu_table(), built.tensormap_fields())
    self.ranks, self.tokens, self.hidden, self.top_k = ranks, tokens, w.hidden, top_k
    sl = lambda a, r: a[r * local:(r + 1) * local]
    none = jnp.zeros((1,), jnp.int8)  # an address for the absent shared expert's four pointers (never read)
    self._weights = [
      [sl(w.w13, r), sl(w.w13_scale, r), sl(w.w2, r), sl(w.w2_scale, r),
       *((shared.s13, shared.s13_scale, shared.s2, shared.s2_scale) if shared else (none,) * 4)]
      for r in range(ranks)]
    self._weights = jax.block_until_ready(self._weights)
    fn = _lib().gcmoe_virtual_ranks_create
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.POINTER(ctypes.c_int64), ctypes.c_float, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.POINTER(ctypes.c_int32), ctypes.c_char_p, ctypes.c_int]
    handle = ctypes.c_void_p()
    part = np.zeros((ranks, 2), np.int32)
    error = ctypes.create_string_buffer(2048)
    rc = fn(key.encode(), device, ranks, d, c, (ctypes.c_int64 * ranks)(*tokens),
            float("inf") if clamp is None else float(clamp), ctypes.byref(handle),
            part.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), error, len(error))
    if rc != 0:
      raise RuntimeError(f"VirtualRanks: creating {ranks} ranks of {self.variant.key} failed: {error.value.decode()}")
    self._handle = handle
    self.partition = part  # [R, 2]: the dispatch and compute SMs each rank got

  @staticmethod
  def _driver_groups(device: int, group_size: int) -> int:
    """How many ``group_size``-SM groups the driver's structured split of ``device`` makes (a simulated split)."""
    fn = _lib().gcmoe_sm_groups
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_int]
    group = ctypes.c_int()
    error = ctypes.create_string_buffer(1024)
    n = fn(device, ctypes.byref(group), error, len(error))
    if n < 0:
      raise RuntimeError(f"VirtualRanks: {error.value.decode()}")
    if group.value != group_size:
      raise RuntimeError(f"VirtualRanks: the driver splits device {device} into groups of {group.value} SMs, the "
                         f"geometry's device facts say {group_size} (check `python -m gcmoe_jax doctor`)")
    return n

  def _pointers(self, xs, ids, weights, ys) -> ctypes.Array:
    if not len(xs) == len(ids) == len(weights) == self.ranks:
      raise ValueError(f"VirtualRanks: x, ids and weights must hold one array per rank ({self.ranks}), got "
                       f"{len(xs)}, {len(ids)} and {len(weights)}")
    out = []
    for r in range(self.ranks):
      t = self.tokens[r]
      if xs[r].shape != (t, self.hidden) or ids[r].shape != (t, self.top_k) or weights[r].shape != (t, self.top_k):
        raise ValueError(f"VirtualRanks: rank {r} holds {t} tokens: x must be [{t}, {self.hidden}] bf16, ids and "
                         f"weights [{t}, {self.top_k}], got {xs[r].shape}, {ids[r].shape}, {weights[r].shape}")
      pad = lambda a: a if t else jnp.zeros((1, *a.shape[1:]), a.dtype)  # an address for a rank with no tokens
      args = [pad(jnp.asarray(xs[r], jnp.bfloat16)), pad(jnp.asarray(ids[r], jnp.int32)),
              pad(jnp.asarray(weights[r], jnp.float32))]
      out.append(args)
    jax.block_until_ready(out)
    self._keep = out  # the buffers must outlive the run
    flat = []
    for r, (x, i, wt) in enumerate(out):
      flat += [_ptr(x), _ptr(i), _ptr(wt), *(_ptr(a) for a in self._weights[r]), _ptr(ys[r]), 0]
    return (ctypes.c_uint64 * len(flat))(*flat)

  def run(self, xs: Sequence[jax.Array], ids: Sequence[jax.Array], weights: Sequence[jax.Array], *,
          repeat: int = 1) -> tuple[list[jax.Array], float]:
    """Runs every rank ``repeat`` times at once; returns (each rank's y ``[T_r, H]`` bf16, seconds per step).

    Raises:
      RuntimeError: with every rank's fault record when a rank faulted (a stalled peer, a bad expert id).
    """
    ys = [jax.device_put(np.zeros((max(t, 1), self.hidden), jnp.bfloat16)) for t in self.tokens]
    ys = jax.block_until_ready(ys)
    ptrs = self._pointers(xs, ids, weights, ys)
    fn = _lib().gcmoe_virtual_ranks_run
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                   ctypes.c_char_p, ctypes.c_int]
    seconds = ctypes.c_double()
    error = ctypes.create_string_buffer(4096)
    if fn(self._handle, ptrs, int(repeat), ctypes.byref(seconds), error, len(error)) != 0:
      raise RuntimeError(f"VirtualRanks: {error.value.decode()}")
    return [y[:t] for y, t in zip(ys, self.tokens)], seconds.value / max(1, repeat)

  def __call__(self, xs, ids, weights) -> list[jax.Array]:
    return self.run(xs, ids, weights)[0]

  def stall(self, rank: int, expert: int) -> None:
    """Test hook: rank ``rank``'s role 1 withholds its local ``expert`` from the next run on (-1: off;
    `abi.STALL_CALL`: the rank never publishes its calls to the peers)."""
    fn = _lib().gcmoe_virtual_ranks_stall
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    error = ctypes.create_string_buffer(1024)
    if fn(self._handle, rank, expert, error, len(error)) != 0:
      raise RuntimeError(f"VirtualRanks: {error.value.decode()}")

  def close(self) -> None:
    """Frees the ranks' workspaces, graphs, streams and green contexts."""
    if self._handle is not None:
      fn = _lib().gcmoe_virtual_ranks_destroy
      fn.argtypes = [ctypes.c_void_p]
      fn.restype = None
      fn(self._handle)
      self._handle = None

  def __enter__(self) -> VirtualRanks:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    self.close()
