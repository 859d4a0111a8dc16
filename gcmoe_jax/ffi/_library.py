"""Finding, loading and registering ``libgcmoe_jax_ffi.so`` (built from ``csrc/`` by ``pip install .``).

The library is found, in order:

1. ``$GCMOE_FFI_LIBRARY`` (a path; when set, nothing else is tried);
2. next to this package (``gcmoe_jax/libgcmoe_jax_ffi.so``: an installed wheel);
3. in the files of the installed ``gcmoe_jax`` distribution (``importlib.metadata``): running ``python -m pytest``
   from a checkout imports the source tree, which has no library, while the installed copy has one;
4. under the checkout's ``build/`` directory (``cmake -S . -B build/dev``, or scikit-build-core's ``build/<tag>``),
   newest first.

Loading and registration happen once, lazily, on first use. The targets and their symbols come from the library
itself (``gcmoe_ffi_build_info()``), so Python registers exactly what was compiled.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import threading
from pathlib import Path
from typing import Any

import jax
import jaxlib

from gcmoe_jax import _compat, _config
from gcmoe_jax._support import Support

LIBRARY_NAME = "libgcmoe_jax_ffi.so"
ENV_LIBRARY = "GCMOE_FFI_LIBRARY"
TARGET = "gcmoe_moe_v1"
# The same op for GCMOE_SYNC_CHECK=1: on CUDA its handler is not command-buffer compatible, so XLA calls it at every
# execution and a device fault is raised by the call that hit it (docs/cuda_runtime.md "Faults").
TARGET_SYNC = "gcmoe_moe_sync_v1"

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
log = logging.getLogger("gcmoe_jax")


@dataclasses.dataclass(frozen=True)
class LibraryInfo:
  """What was loaded: for `platform_support`, ``python -m gcmoe_jax doctor`` and bug reports.

  Attributes:
    path: the library file, or None when none was loaded.
    found_by: which search step found it (see the module doc).
    searched: ``(step, path, outcome)`` for every candidate looked at, in order.
    error: why nothing usable was loaded, or None.
    build: the library's own description (``gcmoe_ffi_build_info()``: version, FFI API, targets, flags), or {}.
    registered: per platform (``"cpu"``, ``"CUDA"``), whether its target was registered and why not.
    source_sha256: digest of the ``csrc/`` files the library was built from.
    source_tree_sha256: the same digest of this checkout's ``csrc/``, or None outside a checkout.
    jax_version, jaxlib_version: the running versions.
    runtime_ffi_api: the FFI C API of the running jaxlib, or None.
  """

  path: str | None
  found_by: str | None
  searched: tuple[tuple[str, str, str], ...]
  error: str | None
  build: dict[str, Any]
  registered: dict[str, Support]
  source_sha256: str | None
  source_tree_sha256: str | None
  jax_version: str
  jaxlib_version: str
  runtime_ffi_api: tuple[int, int] | None

  @property
  def compiled_ffi_api(self) -> tuple[int, int] | None:
    api = self.build.get("ffi_api")
    return None if api is None else (int(api[0]), int(api[1]))

  @property
  def stale(self) -> bool:
    """True when the library was built from other ``csrc/`` sources than this checkout's."""
    return (self.source_tree_sha256 is not None and self.source_sha256 is not None
            and self.source_sha256 != self.source_tree_sha256)

  def __str__(self) -> str:
    lines = [f"library:   {self.path or 'not loaded'}" + (f" (found by {self.found_by})" if self.found_by else "")]
    if self.error:
      lines.append(f"error:     {self.error}")
    for step, path, outcome in self.searched:
      lines.append(f"  searched {step}: {path}: {outcome}")
    if self.build:
      b = self.build
      api = self.compiled_ffi_api
      lines.append(f"built:     gcmoe_jax {b.get('version')}, XLA FFI C API {api[0]}.{api[1]}, "
                   f"{b.get('compiler')}, CUDA handler: "
                   + (f"yes (CUDA {b.get('cuda_version')})" if b.get("cuda") else "no"))
      if self.stale:
        lines.append(f"WARNING:   built from other csrc/ sources than this checkout's ({self.source_sha256[:12]} != "
                     f"{self.source_tree_sha256[:12]}): rebuild (pip install . or cmake --build build/dev)")
    rt = self.runtime_ffi_api
    lines.append(f"runtime:   jax {self.jax_version}, jaxlib {self.jaxlib_version}, XLA FFI C API "
                 + (f"{rt[0]}.{rt[1]}" if rt else "unknown"))
    for platform, s in self.registered.items():
      lines.append(f"target:    {declared_targets(self.build, platform)} on {platform}: "
                   + ("registered" if s.ok else "not registered") + f" ({s.reason})")
    return "\n".join(lines)


class _State:
  """The process-wide result of loading and registering (computed once)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.info: LibraryInfo | None = None
    self.lib: ctypes.CDLL | None = None


_STATE = _State()


def _source_digest(csrc: Path) -> str | None:
  """SHA-256 over ``"<name> <sha256>\\n"`` of every csrc/*.h and *.cc, by name (as CMakeLists.txt computes it)."""
  files = sorted([*csrc.glob("*.h"), *csrc.glob("*.cc")], key=lambda p: p.name)
  if not files:
    return None
  text = "".join(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in files)
  return hashlib.sha256(text.encode()).hexdigest()


def _candidates() -> list[tuple[str, Path]]:
  env = _config.get(ENV_LIBRARY)
  if env:
    return [(f"${ENV_LIBRARY}", Path(env))]
  found = [("package directory", _PACKAGE_DIR / LIBRARY_NAME)]
  try:
    dist = importlib.metadata.distribution("gcmoe_jax")
    for f in dist.files or ():
      if f.name == LIBRARY_NAME:
        found.append(("installed distribution", Path(dist.locate_file(f)).resolve()))
  except importlib.metadata.PackageNotFoundError:
    pass
  build = _PACKAGE_DIR.parent / "build"
  if build.is_dir():
    built = [*build.glob(LIBRARY_NAME), *build.glob(f"*/{LIBRARY_NAME}")]
    for p in sorted(built, key=lambda p: p.stat().st_mtime, reverse=True):
      found.append(("checkout build/ directory", p))
  unique, seen = [], set()
  for step, p in found:
    if p not in seen:
      seen.add(p)
      unique.append((step, p))
  return unique


def declared_targets(build: dict[str, Any] | None, platform: str) -> str:
  """The custom-call targets a library's build info declares for ``platform``, comma-separated (labels)."""
  names = [t for t, platforms in (build or {}).get("targets", {}).items() if platform in platforms]
  return ", ".join(names) or TARGET


def _register(lib: ctypes.CDLL, build: dict[str, Any]) -> dict[str, Support]:
  """Registers every (target, platform) the library declares; returns the outcome per platform."""
  out: dict[str, Support] = {}
  for target, platforms in build.get("targets", {}).items():
    for platform, stages in platforms.items():
      try:
        state_type = stages.get("state_type")
        if state_type is not None:
          # The instantiate stage's state type must be known to XLA before a handler that uses it.
          name, id_symbol, info_symbol = state_type
          type_id, type_info = getattr(lib, id_symbol), getattr(lib, info_symbol)
          type_id.restype = type_info.restype = ctypes.c_void_p
          jax.ffi.register_ffi_type(
            name, {"type_id": jax.ffi.pycapsule(type_id()), "type_info": jax.ffi.pycapsule(type_info())},
            platform=platform)
        handlers = {stage: jax.ffi.pycapsule(getattr(lib, symbol))
                    for stage, symbol in stages.items() if stage in ("instantiate", "prepare", "initialize", "execute")}
        fn = handlers["execute"] if list(handlers) == ["execute"] else handlers
        jax.ffi.register_ffi_target(target, fn, platform=platform, api_version=1)
        outcome = Support(True, f"{target} -> " + ", ".join(f"{k}: {v}" for k, v in stages.items()
                                                            if k != "state_type"))
      except Exception as e:  # noqa: BLE001 - any failure here is reported, not raised, and the platform is off
        outcome = Support(False, f"registering {target} for {platform} failed: {type(e).__name__}: {e}")
      # A platform is on when every target it declares registered (the first failure is the reason otherwise).
      before = out.get(platform)
      if before is None or (before.ok and not outcome.ok):
        out[platform] = outcome
      elif before.ok:
        out[platform] = Support(True, f"{before.reason}; {outcome.reason}")
  return out


def _load() -> LibraryInfo:
  searched: list[tuple[str, str, str]] = []
  lib = path = found_by = None
  for step, candidate in _candidates():
    if not candidate.is_file():
      searched.append((step, str(candidate), "absent"))
      continue
    try:
      lib = ctypes.CDLL(str(candidate))
    except OSError as e:
      searched.append((step, str(candidate), f"cannot load: {e}"))
      continue
    searched.append((step, str(candidate), "loaded"))
    path, found_by = str(candidate), step
    break
  tree = _source_digest(_PACKAGE_DIR.parent / "csrc")
  runtime_api, _ = _compat.runtime_ffi_api()
  common = {"searched": tuple(searched), "source_tree_sha256": tree, "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__, "runtime_ffi_api": runtime_api}
  if lib is None:
    unloadable = [f"{p} ({outcome})" for _, p, outcome in searched if outcome != "absent"]
    if _config.get(ENV_LIBRARY):
      error = f"${ENV_LIBRARY}={_config.get(ENV_LIBRARY)} is not a loadable library ({searched[-1][2]})"
    elif unloadable:
      error = "the gcmoe_jax FFI library was found but cannot be loaded: " + "; ".join(unloadable)
    else:
      error = ("the gcmoe_jax FFI library is not built: no " + LIBRARY_NAME + " found (install the package with "
               "`pip install .`, or build it with `cmake -S . -B build/dev && cmake --build build/dev`)")
    return LibraryInfo(path=None, found_by=None, error=error, build={}, registered={}, source_sha256=None, **common)
  try:
    info_fn = lib.gcmoe_ffi_build_info
    info_fn.restype = ctypes.c_char_p
    build = json.loads(info_fn().decode())
  except (AttributeError, ValueError) as e:
    return LibraryInfo(path=path, found_by=found_by, error=f"{path} is not a gcmoe_jax FFI library: {e}", build={},
                       registered={}, source_sha256=None, **common)
  api = build["ffi_api"]
  compatible = _compat.check_ffi_api((int(api[0]), int(api[1])))
  if not compatible:
    registered = {p: compatible for platforms in build["targets"].values() for p in platforms}
    return LibraryInfo(path=path, found_by=found_by, error=compatible.reason, build=build, registered=registered,
                       source_sha256=build.get("source_sha256"), **common)
  _STATE.lib = lib
  info = LibraryInfo(path=path, found_by=found_by, error=None, build=build, registered=_register(lib, build),
                     source_sha256=build.get("source_sha256"), **common)
  if info.stale:
    log.warning("gcmoe_jax: %s was built from other csrc/ sources than this checkout's; rebuild it (pip install . or "
                "cmake --build build/dev) to test your changes", path)
  return info


def library_info() -> LibraryInfo:
  """Loads and registers the library on first call; returns what happened (never raises)."""
  with _STATE.lock:
    if _STATE.info is None:
      _STATE.info = _load()
    return _STATE.info


def library() -> ctypes.CDLL | None:
  """The loaded library (after `library_info`), or None."""
  library_info()
  return _STATE.lib


def platform_support(platform: str) -> Support:
  """Whether the FFI handler for ``platform`` is built and registered, and why not.

  Args:
    platform: ``"cpu"`` or ``"cuda"``.

  Returns:
    `Support`: the handler is built and registered (whether a GPU can run it is `api`'s check).

  Raises:
    ValueError: for another platform.
  """
  if platform not in ("cpu", "cuda"):
    raise ValueError(f"platform_support: platform must be 'cpu' or 'cuda', got {platform!r}")
  info = library_info()
  if info.error is not None:
    return Support(False, info.error)
  key = "CUDA" if platform == "cuda" else "cpu"
  s = info.registered.get(key)
  if s is None:
    hint = "built without a CUDA toolkit?" if key == "CUDA" else "rebuild it with the default CMake options"
    return Support(False, f"{info.path} declares no {key} target ({hint})")
  if not s.ok:
    return s
  if platform == "cuda":
    return Support(True, f"GC-MoE CUDA runtime ({TARGET}: green contexts, role graph) from {info.path}")
  return Support(True, f"C++ CPU handler {TARGET} from {info.path}")
