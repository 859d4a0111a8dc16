"""Every jax/jaxlib version difference the project depends on, in one place (DESIGN §6.2).

No other module branches on jax versions or imports ``jax._src``. Supported: jax/jaxlib 0.10.2 through 0.12.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jaxlib

from gcmoe_jax._support import Support

__all__ = [
  "JAXLIB_VERSION",
  "JAX_VERSION",
  "ambient_concrete_mesh",
  "distributed_client",
  "check_ffi_api",
  "ffi_result_like",
  "runtime_ffi_api",
]


def _version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


JAX_VERSION: tuple[int, ...] = _version_tuple(jax.__version__)
JAXLIB_VERSION: tuple[int, ...] = _version_tuple(jaxlib.__version__)

# The XLA FFI C API (XLA_FFI_API_MAJOR.MINOR in xla/ffi/api/c_api.h) that each jaxlib release implements, for a
# jaxlib whose wheel lacks its headers (research/jax_ecosystem.md §1).
_FFI_API_BY_JAXLIB = (((0, 12, 0), (0, 5)), ((0, 11, 1), (0, 4)), ((0, 10, 0), (0, 3)))


def runtime_ffi_api() -> tuple[tuple[int, int] | None, str]:
  """The FFI C API version of the installed jaxlib, and where it was read.

  Returns:
    ``((major, minor), source)``, or ``(None, reason)`` when it cannot be told.
  """
  header = os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "include", "xla", "ffi", "api", "c_api.h")
  try:
    with open(header, encoding="utf-8") as f:
      text = f.read()
    major = re.search(r"^#define XLA_FFI_API_MAJOR (\d+)", text, re.MULTILINE)
    minor = re.search(r"^#define XLA_FFI_API_MINOR (\d+)", text, re.MULTILINE)
    if major and minor:
      return (int(major.group(1)), int(minor.group(1))), header
  except OSError:
    pass
  for first, api in _FFI_API_BY_JAXLIB:
    if JAXLIB_VERSION >= first:
      return api, f"jaxlib {jaxlib.__version__} (release table; {header} not readable)"
  return None, f"jaxlib {jaxlib.__version__} is older than every supported release (0.10.2)"


def check_ffi_api(compiled: tuple[int, int]) -> Support:
  """Whether handlers compiled against FFI C API ``compiled`` can be registered with the installed jaxlib.

  A runtime accepts handlers built against its own or an older minor version of the same major version. Registering
  a newer handler is worse than refusing it: the runtime rejects it when it first runs and takes the CPU backend down
  with it ("handler's API version (0.5) is incompatible with the framework's API version (0.3)").
  """
  runtime, source = runtime_ffi_api()
  if runtime is None:
    return Support(False, source)
  if compiled[0] != runtime[0] or compiled[1] > runtime[1]:
    return Support(False, f"the library was compiled against XLA FFI C API {compiled[0]}.{compiled[1]}, newer than "
                          f"the {runtime[0]}.{runtime[1]} of the installed jaxlib {jaxlib.__version__} ({source}); "
                          f"rebuild it against jaxlib==0.10.2 (pip install . does)")
  return Support(True, f"compiled against XLA FFI C API {compiled[0]}.{compiled[1]}, runtime "
                       f"{runtime[0]}.{runtime[1]} (jaxlib {jaxlib.__version__})")


def ffi_result_like(x: Any) -> Any:
  """The result type of an FFI call whose output has ``x``'s shape and dtype.

  ``jax.typeof(x)`` keeps ``x``'s sharding and varying-manual-axes type, so that inside ``shard_map`` the result is
  typed as varying like its operand (a plain ShapeDtypeStruct would be typed invariant and hide a forgotten psum).
  """
  typeof = getattr(jax, "typeof", None)
  if typeof is not None:
    return typeof(x)
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def ambient_concrete_mesh() -> jax.sharding.Mesh | None:
  """The concrete mesh (with devices) set around the current trace, or None; also inside `jax.jit` and `shard_map`.

  ``jax.set_mesh(mesh)`` stores it in the ``device_context`` config (``jax._src.mesh.get_concrete_mesh``, jax 0.10.2
  through 0.12; the public ``jax.sharding.get_mesh`` refuses to run inside `jax.jit`), the deprecated ``with mesh:``
  in ``jax._src.mesh.thread_resources``. ``jax.shard_map(..., mesh=m)`` alone sets only the abstract mesh (no
  devices), so then there is none. A jax that moved either private name gives None, never an error.
  """
  try:
    from jax._src import mesh as mesh_lib
  except ImportError:
    return None
  getters = (lambda: mesh_lib.get_concrete_mesh(), lambda: mesh_lib.thread_resources.env.physical_mesh)
  for get in getters:
    try:
      mesh = get()
    except AttributeError:
      continue
    # Both are jax's private empty Mesh (devices of rank 0) when unset; 0.10.2's device_context may also be None.
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty:
      return mesh
  return None


def distributed_client() -> Any:
  """The `jax.distributed` key-value client, or None in a single-process job (``jax._src.distributed``: the store
  has no public API; jax 0.10.2 through 0.12 share this one)."""
  from jax._src import distributed

  return distributed.global_state.client
