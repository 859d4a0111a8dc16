"""The CUDA backend's Python half: device facts, kernel variants, and their registration with the C++ runtime.

At trace time `prepare` picks the kernel variant of the call (the smallest prebuilt token capacity that holds T),
loads or builds its cubins (`kernels.build.load_or_build`), lays out the workspace (`kernels.abi`), and registers
all of it in the library under a key (``gcmoe_register_variant``); the key becomes the ``variant`` attribute of the
custom call, and the C++ instantiate stage finds the variant by it. Nothing here runs per call.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import importlib.util
import struct
import threading
import warnings
from collections.abc import Callable

import jax
import numpy as np

from gcmoe_jax import _config, geometry, reference
from gcmoe_jax._support import Support
from gcmoe_jax.ffi import _library
from gcmoe_jax.kernels import abi, build

# Token capacities the variants are built for: decode batches up to 256 tokens per rank (the paper's range).
CAPACITIES = (8, 16, 32, 64, 128, 256)
# Compute capability -> the cubin architecture (the MMA seam: sm_90a on Hopper, sm_120a on SM120).
ARCHS = {(9, 0): "sm_90a", (12, 0): "sm_120a", (12, 1): "sm_121a"}


def device_arch(device: jax.Device | None = None) -> Support:
  """``Support(ok, arch or reason)`` for a JAX device (default: the first)."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return Support(False, f"needs a CUDA GPU, and the device is {device.platform}")
  cc = getattr(device, "compute_capability", None)
  try:
    major, minor = (int(v) for v in str(cc).split("."))
  except ValueError:
    return Support(False, f"cannot read the compute capability of {device} (got {cc!r})")
  arch = ARCHS.get((major, minor))
  if arch is None:
    return Support(False, f"compute capability {major}.{minor} is not supported (supported: "
                          f"{', '.join(f'{a}.{b}' for a, b in ARCHS)})")
  return Support(True, arch)


@functools.lru_cache(maxsize=None)
def device_facts(ordinal: int, arch: str) -> tuple[geometry.Device, str]:
  """The geometry's facts about CUDA device ``ordinal``, read from the driver through ``cuda.bindings``.

  Returns:
    ``(device, source)``; without ``cuda.bindings`` (the ``cuda`` extra) the preset of the architecture, and the
    source says so. The runtime re-reads the split from the driver and rejects a mismatch, so a preset cannot run
    a wrong partition silently.
  """
  preset = geometry.H200 if arch == "sm_90a" else geometry.RTX_PRO_5000
  try:
    from cuda.bindings import driver as cu
  except ImportError as e:
    return preset, f"preset {preset.name} (cuda.bindings not importable: {e})"

  def get(result):
    err, *value = result
    if err != cu.CUresult.CUDA_SUCCESS:
      raise RuntimeError(f"gcmoe_jax: reading device facts failed: {err}")
    return value[0] if len(value) == 1 else value

  get(cu.cuInit(0))
  dev = get(cu.cuDeviceGet(ordinal))
  a = cu.CUdevice_attribute
  attr = lambda name: int(get(cu.cuDeviceGetAttribute(getattr(a, name), dev)))
  res = get(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
  facts = dataclasses.replace(
    preset, name=f"device {ordinal}", arch=arch, sm_count=attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
    smem_per_sm=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
    smem_per_block=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
    regs_per_sm=attr("CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR"),
    max_threads_per_sm=attr("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR"),
    gc_alignment=max(1, int(res.sm.smCoscheduledAlignment)), min_partition_sms=int(res.sm.minSmPartitionSize))
  return facts, "cuda.bindings.driver"


def kernels_support() -> Support:
  """Whether role-kernel cubins can be had here: prebuilt (``GCMOE_CUBIN_DIR``) or compiled (CuTe DSL importable)."""
  if _config.get("GCMOE_CUBIN_DIR"):
    return Support(True, f"prebuilt cubins from GCMOE_CUBIN_DIR={_config.get('GCMOE_CUBIN_DIR')}")
  if importlib.util.find_spec("cutlass") is not None:
    return Support(True, "cubins compiled on first use by CuTe DSL")
  return Support(False, "no role-kernel cubins: install nvidia-cutlass-dsl (the `kernels` extra) to compile them, or "
                        "set GCMOE_CUBIN_DIR to a directory built by `python -m gcmoe_jax build-kernels`")


def capacity_for(tokens: int) -> int:
  for c in CAPACITIES:
    if tokens <= c:
      return c
  raise ValueError(f"moe: the CUDA backend runs decode batches of at most {CAPACITIES[-1]} tokens per call (per "
                   f"rank), got T = {tokens}; split the batch or use backend='cpu'/'reference'")


def register_raw(key: str, config: tuple[int, ...], launch: tuple[int, ...], cubins: list[bytes],
                 silu: np.ndarray, tensormaps: tuple[int, ...] = ()) -> None:
  """``gcmoe_register_variant`` with typed arguments (ctypes passes untyped Python ints as 32-bit C ints).

  Args:
    key: the variant key (the ``variant`` attribute of calls that use it).
    config: (capacity, dispatch SMs requested, timeout ns, workspace bytes, silu table offset[, compute SMs the
      geometry planned: the runtime rejects a driver split that differs; 0 or absent: not checked[, R ranks (1: one
      GPU)[, the tokens up to which role 3 may run beside role 2 (`abi.FINALIZE_EARLY_TOKENS`; 0 or absent: never)[,
      the tokens up to which the graph holds role 2 alone (`abi.scan_tokens`; 0 or absent: never), role 2's
      combining CTAs per token there (`abi.solo_ctas`)[, where role 2 alone runs (0: the compute partition, 1: every
      SM, ``GCMOE_SOLO_SMS=all``)[, where the three-node graph runs (0: the green contexts, 1: the stream's own
      context, one GPU only, ``GCMOE_GRAPH_CONTEXT=stream``)[, with R > 1 the CUDA ordinals of the fused transport's
      peer groups, group-major]]]]]]]).
    launch: (grid, block, dynamic SMEM) of roles 1, 2, 3; grid 0 is the runtime's choice.
    cubins: the three role cubins. silu: the float32 table of `reference.silu_table`.
    tensormaps: role 2's TensorMaps (`build.BuiltVariant.tensormap_fields`): the runtime encodes them from the
      call's pointers and passes them by value after the ABI's formals.
  """
  lib = _library.library()
  if lib is None:
    raise RuntimeError(f"gcmoe_jax FFI: {_library.library_info().error}")
  fn = lib.gcmoe_register_variant
  fn.restype = ctypes.c_int
  fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.POINTER(ctypes.c_uint32),
                 ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64,
                 ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                 ctypes.c_char_p, ctypes.c_int]
  silu = np.ascontiguousarray(silu, np.float32)
  error = ctypes.create_string_buffer(1024)
  rc = fn(key.encode(), (ctypes.c_int64 * len(config))(*config), len(config), (ctypes.c_uint32 * 9)(*launch),
          cubins[0], len(cubins[0]), cubins[1], len(cubins[1]), cubins[2], len(cubins[2]),
          silu.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), silu.size,
          (ctypes.c_int64 * max(len(tensormaps), 1))(*tensormaps), len(tensormaps), error, len(error))
  if rc != 0:
    raise RuntimeError(f"gcmoe_jax: registering kernel variant {key} failed: {error.value.decode()}")


def workspace_bytes(ws: abi.Workspace) -> int:
  """Bytes the runtime allocates for a workspace: its sections, and with ``GCMOE_ABLATION=timeline`` the timeline
  the kernels stamp after them (`abi.TIMELINE_BYTES`, read by `debug_read_workspace`)."""
  return ws.total + (abi.TIMELINE_BYTES if _config.timeline_build() else 0)


@functools.lru_cache(maxsize=None)
def _register(arch: str, variant: build.Variant, dispatch_sms: int, compute_sms: int, timeout_ns: int,
              peer_devices: tuple[int, ...] = (), partition_dispatch_sms: int = 0, solo: bool = True,
              solo_sms: str = "all", graph_context: str = "stream") -> str:
  ablation = _config.get("GCMOE_ABLATION")
  if ablation:
    # A timing build (docs/kernels_v2.md) must never pass for the operator: say so at every variant it serves.
    warnings.warn(f"GCMOE_ABLATION={ablation}: the role kernels of {variant.key} are built with a part left out or "
                  f"changed for timing; its results may be WRONG (unset GCMOE_ABLATION for real runs)",
                  RuntimeWarning, stacklevel=2)
  built = build.load_or_build(arch, variant)
  ws = variant.workspace()
  key = f"{build.cache_key(arch, variant)}:d{dispatch_sms}:c{compute_sms}:t{timeout_ns}"
  # One GPU, v2 kernels: role 3 may run beside role 2 up to `abi.FINALIZE_EARLY_TOKENS` (its v2 kernel waits for
  # role 2's CTAs where the runtime put it there), and up to `abi.scan_tokens` role 2 runs alone (unless GCMOE_SOLO=0).
  one_gpu_v2 = variant.ranks == 1 and build.generation() == "v2"
  early = abi.FINALIZE_EARLY_TOKENS if one_gpu_v2 else 0
  solo_tokens = abi.scan_tokens(variant.top_k, variant.capacity) if one_gpu_v2 and solo else 0
  # Role 2 alone over every SM (GCMOE_SOLO_SMS=all) or on the compute partition.
  solo_all = int(bool(solo_tokens) and solo_sms == "all")
  # The three-node graph on the stream's own context (GCMOE_GRAPH_CONTEXT=stream), one GPU only.
  on_stream = int(variant.ranks == 1 and graph_context == "stream")
  key += f":s{solo_tokens}" + (":all" if solo_all else "") + (":stream" if on_stream else "")
  config = (variant.capacity, dispatch_sms, timeout_ns, workspace_bytes(ws), ws.silu_table, compute_sms,
            variant.ranks, early, solo_tokens, abi.solo_ctas(variant.hidden, 1) if solo_tokens else 0, solo_all,
            on_stream)
  launch = tuple(v for r in (1, 2, 3) for v in built.launch(r, compute_sms))
  if variant.ranks > 1:
    # The fused transport: the CUDA ordinals of every peer group, group-major; role 1's pulls spread over the
    # dispatch partition (`BuiltVariant.dispatch_grid`, as in `VirtualRanks`).
    key += ":peers" + ",".join(map(str, peer_devices))
    config += tuple(peer_devices)
    launch = (built.dispatch_grid(partition_dispatch_sms), *launch[1:])
  register_raw(key, config, launch, [built.cubin(r) for r in (1, 2, 3)], reference.silu_table(),
               built.tensormap_fields())
  return key


# Exchanges every process's bytes for a name (`sharding._peers.exchange`: jax.distributed's key-value store).
Exchange = Callable[[str, bytes], list[bytes]]


def prepare(hidden: int, intermediate: int, experts: int, top_k: int, tokens: int, shared_intermediate: int,
            shared_group: int, peer_groups: tuple[tuple[int, ...], ...] = (),
            exchange: Exchange | None = None) -> str:
  """Registers the kernel variant of a call and returns its key (the ``variant`` attribute).

  ``peer_groups``: for the fused transport, every group of R ranks in rank order (``experts`` is then the L local
  experts of a rank): this process's devices as CUDA ordinals, another process's as -(1 + its process index);
  empty for a local call. Groups that span processes are connected here, before the first call: each process's
  rank exports its workspace's CUDA IPC handle and ``exchange`` gives it every other's (`connect_processes`). The
  fused variant's return path (direct or relay) is `geometry.relay_staging` at B = the token capacity.
  """
  s = device_arch()
  if not s.ok:
    raise RuntimeError(f"moe: backend='cuda' cannot run here: {s.reason}")
  ranks = len(peer_groups[0]) if peer_groups else 1
  capacity = capacity_for(tokens)
  # The fused transport's return path is the geometry's (§4.4) at the variant's design point, B = capacity.
  relay = ranks > 1 and geometry.relay_staging(ranks, capacity, capacity, top_k, experts, hidden,
                                               bool(shared_intermediate))[0]
  variant = build.Variant(hidden, intermediate, experts, top_k, capacity, shared_intermediate or None,
                          shared_group or None, ranks, relay)
  timeout_ns = int(_config.get("GCMOE_WAIT_TIMEOUT_MS")) * 1_000_000
  # The green-context split is the geometry's (eq. 5) for this device's facts; the runtime checks that the driver's
  # split matches it.
  facts, _ = device_facts(jax.devices()[0].id, s.reason)
  request = geometry.dispatch_request(facts, _config.get("GC_MOE_SM120_DISPATCH_SMS"), peers=bool(peer_groups))
  partition, problems = geometry.split_sms(facts, request)
  if problems:
    raise ValueError("moe: the green-context split cannot run here: " + "; ".join(problems))
  key = _register(s.reason, variant, partition.dispatch_requested, partition.compute_sms, timeout_ns,
                  tuple(d for g in peer_groups for d in g), partition.dispatch_sms if peer_groups else 0,
                  _config.get("GCMOE_SOLO"), _config.get("GCMOE_SOLO_SMS"), _config.get("GCMOE_GRAPH_CONTEXT"))
  if any(d < 0 for g in peer_groups for d in g):
    connect_processes(key, f"{build.cache_key(s.reason, variant)}.g{len(peer_groups)}", peer_groups, exchange)
  return key


# ---- The fused transport across processes (CUDA IPC; docs/fused_transport.md "Across processes") ----------------

IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE
_RECORD = struct.Struct("<ii")  # (group index, rank) before each handle of an exchange payload
_connected: set[str] = set()
_exchanges: collections.Counter[str] = collections.Counter()
_connect_lock = threading.Lock()
_releases = 0  # release_processes calls so far (names its barriers)


def _ipc_export(key: str, device: int, rank: int) -> bytes:
  """The IPC handle of rank ``rank``'s workspace of variant ``key`` on CUDA ordinal ``device`` (allocated and
  initialised by the library on first use, its first call's waits bounded by GCMOE_FIRST_WAIT_TIMEOUT_MS: the peer
  processes reach their first call after compiling, not together)."""
  fn = _library.library().gcmoe_ipc_export
  fn.restype = ctypes.c_int
  fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_char_p, ctypes.c_char_p,
                 ctypes.c_int]
  handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
  error = ctypes.create_string_buffer(1024)
  first_ns = int(_config.get("GCMOE_FIRST_WAIT_TIMEOUT_MS")) * 1_000_000
  if fn(key.encode(), device, rank, first_ns, handle, error, len(error)) != 0:
    raise RuntimeError(f"moe: transport='fused': exporting rank {rank}'s workspace on device {device} failed: "
                       f"{error.value.decode()}")
  return handle.raw


def _ipc_connect(key: str, device: int, handles: list[bytes]) -> None:
  """Opens the other ranks' workspaces (``handles`` in rank order) and writes this rank's peer table."""
  fn = _library.library().gcmoe_ipc_connect
  fn.restype = ctypes.c_int
  fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
  error = ctypes.create_string_buffer(2048)
  if fn(key.encode(), device, b"".join(handles), len(handles), error, len(error)) != 0:
    raise RuntimeError(f"moe: transport='fused': opening the peers' workspaces on device {device} failed: "
                       f"{error.value.decode()}")


def connect_processes(key: str, name: str, peer_groups: tuple[tuple[int, ...], ...],
                      exchange: Exchange | None) -> None:
  """Connects this process's ranks of the groups that span processes, once per variant ``key``: each exports its
  workspace's IPC handle (the workspace initialised first, so a handle another process holds always points at a
  ready workspace), every process's handles come back from ``exchange`` (under ``name``, the same in every process,
  numbered by how often it was exchanged: every process traces the same calls in the same order), and each rank
  opens its peers'. Outside any jitted program and graph capture (at trace time).

  Raises:
    ValueError: without an ``exchange``.
    TimeoutError: from ``exchange``, with the variant's name (a process that built another variant never meets).
    RuntimeError: a process sent no handle for a rank it holds, or the driver refused to map one.
  """
  with _connect_lock:
    if key in _connected:
      return
    if exchange is None:
      raise ValueError("moe: transport='fused' over devices of other processes needs an exchange of their "
                       "workspace handles (sharding passes jax.distributed's); got exchange=None")
    mine = {}  # group -> (CUDA ordinal, rank, handle)
    for g, group in enumerate(peer_groups):
      local = [(r, d) for r, d in enumerate(group) if d >= 0]
      if local and len(local) < len(group):
        (r, d), = local  # the library allows one of this process's devices beside another process's
        mine[g] = (d, r, _ipc_export(key, d, r))
    payload = b"".join(_RECORD.pack(g, r) + h for g, (_, r, h) in mine.items())
    n = _exchanges[name]
    _exchanges[name] += 1
    try:
      got = exchange(f"{name}.{n}", payload)
    except TimeoutError as e:
      raise TimeoutError(f"{e} (moe: transport='fused' names the exchange by the kernel variant, here {name!r}: a "
                         "process that traced other shapes or runs other kernels, GCMOE_KERNELS or GCMOE_ABLATION, "
                         "publishes under another name)") from e
    step = _RECORD.size + IPC_HANDLE_BYTES
    sent = [{_RECORD.unpack_from(p, o): p[o + _RECORD.size:o + step] for o in range(0, len(p), step)} for p in got]
    for g, (d, r, h) in mine.items():
      handles = []
      for q, entry in enumerate(peer_groups[g]):
        if q == r:
          handles.append(h)
          continue
        p = -1 - entry
        if not 0 <= p < len(sent) or (g, q) not in sent[p]:
          raise RuntimeError(f"moe: transport='fused': process {p} sent no workspace handle for rank {q} of peer "
                             f"group {g} (its peer groups differ from this process's {peer_groups}: every process "
                             f"must trace the call over the same mesh)")
        handles.append(sent[p][(g, q)])
      _ipc_connect(key, d, handles)
    _connected.add(key)


def release_processes(exchange: Exchange) -> int:
  """Releases this process's ranks of the fused transport's groups across processes; collective: every process
  of the job calls it, after its last call through them. Each process waits for its work on those devices, meets
  the others through ``exchange`` (so no peer still reads a workspace when it goes), then retires its groups:
  their programs refuse further calls (naming the release), and each workspace and peer mapping is freed with the
  last program that holds it (`jax.clear_caches()` drops jax's). A later trace connects anew. Returns how many
  groups this process retired (0 without any: groups in one process and virtual ranks free with their programs).

  Raises:
    RuntimeError: the driver's error while waiting for the devices (nothing is released then).
  """
  global _releases
  with _connect_lock:
    lib = _library.library()
    sync = getattr(lib, "gcmoe_ipc_release", None) if lib is not None else None
    if sync is not None:
      sync.restype = ctypes.c_int
      sync.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
      error = ctypes.create_string_buffer(1024)
      if sync(0, error, len(error)) != 0:
        raise RuntimeError(f"release_fused_workspaces: waiting for this process's devices failed: "
                           f"{error.value.decode()}")
    name = f"gcmoe_jax.release.{_releases}"
    _releases += 1  # before the barrier: names are single-use, and a release that timed out may be retried
    exchange(name, b"")  # the barrier: every process is done with every workspace
    retired = sync(1, None, 0) if sync is not None else 0
    _connected.clear()
    return int(retired)


def _process_counter(symbol: str) -> int:
  """An ``int64_t symbol(void)`` counter exported by the FFI library."""
  fn = getattr(_library.library(), symbol)
  fn.argtypes = []
  fn.restype = ctypes.c_int64
  return int(fn())


def graph_instantiations() -> int:
  """CUDA graphs instantiated in this process so far: one per graph-cache key (variant, T, clamp, device, stream),
  shared by every call site with that key; never per call."""
  return _process_counter("gcmoe_graph_instantiations")


def live_states() -> int:
  """CUDA call-site states alive in this process (each holds a reference to its runtimes)."""
  return _process_counter("gcmoe_live_states")


def live_runtimes() -> int:
  """CUDA runtimes alive in this process (graph-cache entries in use; each owns a workspace and a graph)."""
  return _process_counter("gcmoe_live_runtimes")


def debug_set_stall_expert(expert: int, device: int | None = None) -> None:
  """Test hook: role 1 of every later call withholds local ``expert`` (-1: off), so role 2's wait expires.

  ``device``: the CUDA device ordinal whose calls stall (one rank of an expert-parallel mesh); None: every device.
  """
  lib = _library.library()
  lib.gcmoe_debug_set_stall_expert(ctypes.c_int32(expert), ctypes.c_int32(-1 if device is None else device))


def debug_read_workspace(offset: int | None = None, nbytes: int | None = None) -> bytes:
  """Debug hook: bytes of the workspace of the most recently created CUDA runtime in this process (the timeline
  build reads its stamps with it: `gcmoe_jax.bench.timeline`). Wait for the calls first (``block_until_ready``).

  ``offset`` None: the whole workspace; negative: counted from its end (the timeline: ``-abi.TIMELINE_BYTES``);
  ``nbytes`` None: up to its end.

  Raises:
    RuntimeError: no runtime alive, a range outside the workspace, or a driver error (the message says which).
  """
  lib = _library.library()
  if lib is None:
    raise RuntimeError(f"gcmoe_jax FFI: {_library.library_info().error}")
  lib.gcmoe_debug_workspace_bytes.restype = ctypes.c_int64
  total = int(lib.gcmoe_debug_workspace_bytes())
  offset = 0 if offset is None else int(offset) + (total if offset < 0 else 0)
  nbytes = total - offset if nbytes is None else int(nbytes)
  out = ctypes.create_string_buffer(max(nbytes, 1))
  error = ctypes.create_string_buffer(1024)
  fn = lib.gcmoe_debug_read_workspace
  fn.restype = ctypes.c_int
  fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
  if fn(offset, nbytes, out, error, len(error)) != 0:
    raise RuntimeError(f"gcmoe_jax: reading the workspace failed: {error.value.decode()}")
  return out.raw[:nbytes]


_TRACE_SLOTS = 1024  # csrc/gc_runtime.cc kTraceSlots


def debug_trace() -> np.ndarray:
  """Debug hook (``GCMOE_DEBUG_TRACE=1`` set before the first call): the graph launches since the last read, oldest
  first (the newest ``_TRACE_SLOTS`` when there were more), as float64 ``[n, 6]``: host entry (us from the first),
  the parameter update (us), the cuGraphLaunch (us), updated (1 when the graph's parameters were rewritten: new
  buffers, or the first launch after a capture), the GPU start (us from the first, by CUDA events on the call's
  stream; -1 for another device) and the graph's GPU time (us). Waits for each record's events; clears the trace.
  Read it when no call is in flight (after ``block_until_ready``). Calls replayed inside an XLA command buffer are
  not launches: not in it.

  Raises:
    RuntimeError: the library is missing or a driver call failed (the message says which).
  """
  lib = _library.library()
  if lib is None:
    raise RuntimeError(f"gcmoe_jax FFI: {_library.library_info().error}")
  fn = lib.gcmoe_debug_trace
  fn.restype = ctypes.c_int
  fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
  out = np.zeros((_TRACE_SLOTS, 6), np.float64)
  error = ctypes.create_string_buffer(1024)
  n = fn(out.ctypes.data, out.shape[0], error, len(error))
  if n < 0:
    raise RuntimeError(f"gcmoe_jax: reading the trace failed: {error.value.decode()}")
  return out[:n].copy()


def debug_peer_probe(ranks: int, dispatch_sms: int, compute_sms: int, cubin: bytes, *, device: int = 0,
                     timeout_ms: int = 2000) -> tuple[np.ndarray, np.ndarray]:
  """Test hook for the fused transport's virtual ranks (issue 9): R (dispatch, compute) green-context pairs on one
  GPU, R workspaces with a peer table, and one probe kernel per rank launched at once (``cubin``: built from
  csrc/kernels/peer_probe.cu); each rank writes into every peer's mailbox and waits, bounded, for all of its own.

  Returns:
    ``seen`` int ``[R, R]`` (``seen[r, p] == p + 1`` when rank r saw rank p's write, 0 when it never arrived) and
    ``partition`` int ``[R, 2]`` (dispatch, compute SMs each rank's pair got).

  Raises:
    RuntimeError: naming the driver call or the split that failed.
  """
  lib = _library.library()
  if lib is None:
    raise RuntimeError(f"gcmoe_jax FFI: {_library.library_info().error}")
  fn = lib.gcmoe_peer_probe
  fn.restype = ctypes.c_int
  fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int64,
                 ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_int32), ctypes.c_char_p, ctypes.c_int]
  seen = np.zeros((ranks, ranks), np.uint32)
  partition = np.zeros((ranks, 2), np.int32)
  error = ctypes.create_string_buffer(1024)
  rc = fn(device, ranks, dispatch_sms, compute_sms, cubin, int(timeout_ms) * 1_000_000,
          seen.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
          partition.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), error, len(error))
  if rc != 0:
    raise RuntimeError(f"gcmoe_jax: the virtual-rank probe failed: {error.value.decode()}")
  return seen, partition
