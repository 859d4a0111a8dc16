"""The XLA FFI custom call ``gcmoe_moe_v1`` (``gcmoe_moe_sync_v1`` with GCMOE_SYNC_CHECK=1): library loading,
registration, the primitive path and its rules.

``libgcmoe_jax_ffi.so`` (built from ``csrc/`` by ``pip install .``) holds the CPU handler and, when built with a CUDA
toolkit, the CUDA handler. It is loaded and its targets registered lazily, once, on first use (`_library`); calls go
through one `jax.ffi.ffi_call` path (`_moe`).
"""

from gcmoe_jax.ffi._library import TARGET as TARGET
from gcmoe_jax.ffi._library import TARGET_SYNC as TARGET_SYNC
from gcmoe_jax.ffi._library import declared_targets as declared_targets
from gcmoe_jax.ffi._library import LibraryInfo as LibraryInfo
from gcmoe_jax.ffi._library import library as library
from gcmoe_jax.ffi._library import library_info as library_info
from gcmoe_jax.ffi._library import platform_support as platform_support
from gcmoe_jax.ffi._moe import FORWARD_ONLY as FORWARD_ONLY
from gcmoe_jax.ffi._moe import Flag as Flag
from gcmoe_jax.ffi._moe import MoeAttrs as MoeAttrs
from gcmoe_jax.ffi._moe import moe_call as moe_call
from gcmoe_jax.ffi._moe import moe_ffi as moe_ffi
from gcmoe_jax.ffi._moe import moe_fused_call as moe_fused_call
from gcmoe_jax.ffi._moe import no_shared_operands as no_shared_operands
from gcmoe_jax.ffi._cuda import debug_peer_probe as debug_peer_probe
from gcmoe_jax.ffi._cuda import debug_set_stall_expert as debug_set_stall_expert
from gcmoe_jax.ffi._cuda import device_arch as device_arch
from gcmoe_jax.ffi._cuda import graph_instantiations as graph_instantiations
from gcmoe_jax.ffi._cuda import live_runtimes as live_runtimes
from gcmoe_jax.ffi._cuda import live_states as live_states
from gcmoe_jax.ffi._cuda import release_processes as release_processes
from gcmoe_jax.ffi._cuda import kernels_support as kernels_support
from gcmoe_jax.ffi._virtual import VirtualRanks as VirtualRanks
