"""``python -m gcmoe_jax doctor``: what this machine and this install can run, on one screen.

Reports the FFI library (path, how it was found, what it was built against, handlers registered per platform), the
jax/jaxlib versions and devices, every ``GCMOE_*`` setting with its value (and any set ``GCMOE_*`` variable that
gcmoe_jax does not read, a misspelt setting, or a malformed value), and for CUDA: the driver version, and per GPU the
compute capability, SM count and green-context support. GPU facts come from ``cuda.bindings.driver`` when it is
importable; otherwise from jax's device objects and the library's own driver probe, and the report says so.

Exit status: 0 when the CPU handler is usable, 1 otherwise (the report says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from typing import Any

import jax
import jaxlib

from gcmoe_jax import _config, api, ffi

# Green contexts (cuGreenCtxCreate) need a CUDA 12.4 driver; balanced workqueues (CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG)
# and cuDevSmResourceSplit need 13.1 (DESIGN §5, measured on the H100).
GREEN_CTX_MIN_DRIVER = 12040
WORKQUEUE_MIN_DRIVER = 13010
RELATED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def register(subparsers: argparse._SubParsersAction) -> None:
  """Adds the ``doctor`` command."""
  p = subparsers.add_parser("doctor", help="report the FFI library, handlers, JAX, devices, CUDA and GCMOE_* settings",
                            description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true", help="print the report as one JSON object")
  p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
  """Prints the report; returns 0 when the CPU handler is usable, else 1."""
  report = collect()
  if getattr(args, "json", False):
    print(json.dumps(report, indent=2, default=str))
  else:
    print(format_report(report))
  return 0 if report["handlers"]["cpu"]["ok"] else 1


# ---------------------------------------------------------------------------------------------------------------
# Collection
# ---------------------------------------------------------------------------------------------------------------


def collect() -> dict[str, Any]:
  """Everything the report shows, as plain data (JSON-serialisable)."""
  info = ffi.library_info()
  # What `gm.moe` would do here (device and arch included), not only whether the handlers are built.
  reasons = api.backend_support()
  cpu, cuda = reasons["cpu"], reasons["cuda"]
  return {
    "python": f"{sys.version.split()[0]} ({sys.executable})",
    "platform": platform.platform(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "library": {
      "path": info.path,
      "found_by": info.found_by,
      "error": info.error,
      "searched": [list(s) for s in info.searched],
      "build": info.build,
      "stale": info.stale,
      "runtime_ffi_api": info.runtime_ffi_api,
      "registered": {p: s._asdict() for p, s in info.registered.items()},
    },
    "handlers": {"cpu": cpu._asdict(), "cuda": cuda._asdict()},
    "devices": _devices(),
    "settings": _config.snapshot(),
    "unknown_environment": _config.unknown(),
    "related_environment": {k: os.environ[k] for k in RELATED_ENV if k in os.environ},
    "cuda": probe_cuda(),
  }


def _devices() -> dict[str, Any]:
  out: dict[str, Any] = {"default_backend": jax.default_backend(), "devices": []}
  for d in jax.devices():
    entry = {"id": d.id, "platform": d.platform, "kind": getattr(d, "device_kind", "?")}
    cc = getattr(d, "compute_capability", None)
    if cc is not None:
      entry["compute_capability"] = str(cc)
    out["devices"].append(entry)
  return out


@dataclasses.dataclass
class _Gpu:
  index: int
  name: str
  compute_capability: str
  sms: int | None


def probe_cuda(driver: Any = None) -> dict[str, Any]:
  """The CUDA driver and GPUs as seen by ``cuda.bindings.driver`` (or ``driver``, a module with its API).

  Never raises: every failure becomes a line of the report.
  """
  out: dict[str, Any] = {"source": None, "driver_version": None, "gpus": [], "notes": []}
  if driver is None:
    try:
      from cuda.bindings import driver  # optional dependency (the `cuda` extra)
    except ImportError as e:
      out["notes"].append(f"cuda.bindings is not importable ({e}); install the `cuda` extra for GPU details")
      driver = None
  if driver is not None:
    out["source"] = "cuda.bindings.driver"
    try:
      _check(driver, driver.cuInit(0), "cuInit(0)")
      out["driver_version"] = _check(driver, driver.cuDriverGetVersion(), "cuDriverGetVersion()")
      count = _check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount()")
      attr = driver.CUdevice_attribute
      for i in range(count):
        dev = _check(driver, driver.cuDeviceGet(i), f"cuDeviceGet({i})")
        major = _check(driver, driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                       "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)")
        minor = _check(driver, driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                       "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)")
        sms = _check(driver, driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                     "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)")
        name = _check(driver, driver.cuDeviceGetName(256, dev), "cuDeviceGetName()")
        name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
        out["gpus"].append(dataclasses.asdict(_Gpu(i, name, f"{major}.{minor}", int(sms))))
    except Exception as e:  # noqa: BLE001 - no driver, no GPU, or an old binding: report it
      out["notes"].append(f"cuda.bindings.driver: {type(e).__name__}: {e}")
    out["green_context_api"] = hasattr(driver, "cuGreenCtxCreate")
  if out["driver_version"] is None:
    version, why = _library_driver_version()
    if version is not None:
      out["driver_version"], out["source"] = version, out["source"] or "libgcmoe_jax_ffi.so (dlopen libcuda.so.1)"
    elif why:
      out["notes"].append(why)
  if not out["gpus"]:
    # Without cuda.bindings, jax's own GPU devices still give the compute capability.
    for d in jax.devices():
      if d.platform == "gpu":
        out["gpus"].append(dataclasses.asdict(_Gpu(d.id, getattr(d, "device_kind", "?"),
                                                   str(getattr(d, "compute_capability", "?")), None)))
  v = out["driver_version"]
  if v is not None:
    out["green_contexts"] = v >= GREEN_CTX_MIN_DRIVER and out.get("green_context_api", True)
    out["workqueue_split"] = v >= WORKQUEUE_MIN_DRIVER
  return out


def _check(driver: Any, result: Any, what: str) -> Any:
  """Unpacks a cuda.bindings ``(CUresult, value...)`` tuple, raising on an error code."""
  result = tuple(result) if isinstance(result, (tuple, list)) else (result,)
  err, values = result[0], result[1:]
  if err != driver.CUresult.CUDA_SUCCESS:
    raise RuntimeError(f"{what} failed: {getattr(err, 'name', err)}")
  return values[0] if len(values) == 1 else values


def _library_driver_version() -> tuple[int | None, str | None]:
  lib = ffi.library()
  if lib is None:
    return None, None
  fn = getattr(lib, "gcmoe_cuda_driver_version", None)
  if fn is None:
    return None, "libgcmoe_jax_ffi.so was built without CUDA: no driver probe"
  import ctypes

  buf = ctypes.create_string_buffer(512)
  fn.restype, fn.argtypes = ctypes.c_int, (ctypes.c_char_p, ctypes.c_int)
  version = fn(buf, len(buf))
  if version > 0:
    return version, None
  return None, f"CUDA driver: {buf.value.decode(errors='replace')}"


# ---------------------------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------------------------


def _driver_str(v: int | None) -> str:
  return "unknown" if v is None else f"{v // 1000}.{v % 1000 // 10} ({v})"


def format_report(r: dict[str, Any]) -> str:
  """The report as text, one fact per line."""
  lib = r["library"]
  lines = ["gcmoe_jax doctor", "", f"python      {r['python']}", f"platform    {r['platform']}",
           f"jax         {r['jax']}, jaxlib {r['jaxlib']}", ""]
  lines.append(f"library     {lib['path'] or 'not loaded'}" + (f"  (found by {lib['found_by']})" if lib["found_by"]
                                                                 else ""))
  if lib["error"]:
    lines.append(f"  error     {lib['error']}")
  for step, path, outcome in lib["searched"]:
    lines.append(f"  searched  {step}: {path}: {outcome}")
  b = lib["build"]
  if b:
    api, rt = b.get("ffi_api"), lib["runtime_ffi_api"]
    lines.append(f"  built     version {b.get('version')}, compiler {b.get('compiler')}, XLA FFI C API "
                 f"{api[0]}.{api[1]} (runtime " + (f"{rt[0]}.{rt[1]})" if rt else "unknown)"))
    lines.append("  CUDA      " + (f"handler compiled (CUDA toolkit {b.get('cuda_version')})" if b.get("cuda")
                                   else "handler not compiled (no CUDA toolkit at build time)"))
    if lib["stale"]:
      lines.append("  WARNING   built from other csrc/ sources than this checkout's: rebuild it")
  for p, s in lib["registered"].items():
    lines.append(f"  target    {ffi.declared_targets(b, p)} on {p}: "
                 + ("registered" if s["ok"] else "NOT registered") +
                 f" ({s['reason']})")
  lines.append("")
  for p, s in r["handlers"].items():
    lines.append(f"backend {p:<4} " + ("usable      " if s["ok"] else "unavailable ") + s["reason"])
  lines.append("")
  dev = r["devices"]
  lines.append(f"devices     default backend {dev['default_backend']}: " + ", ".join(
    f"{d['platform']}:{d['id']} {d['kind']}" + (f" (sm {d['compute_capability']})" if "compute_capability" in d
                                                else "") for d in dev["devices"]))
  c = r["cuda"]
  lines.append(f"CUDA driver {_driver_str(c['driver_version'])}" + (f"  (via {c['source']})" if c["source"] else ""))
  if not c["gpus"]:
    lines.append("GPUs        none")
  for g in c["gpus"]:
    lines.append(f"GPU {g['index']:<7} {g['name']}, compute capability {g['compute_capability']}" +
                 (f", {g['sms']} SMs" if g["sms"] is not None else ""))
  if "green_contexts" in c:
    lines.append("green ctx   " + ("supported" if c["green_contexts"] else "NOT supported") +
                 f" (cuGreenCtxCreate needs driver >= {_driver_str(GREEN_CTX_MIN_DRIVER)})")
    lines.append("workqueues  " + ("supported" if c["workqueue_split"] else "not supported") +
                 f" (balanced workqueues, cuDevSmResourceSplit: driver >= {_driver_str(WORKQUEUE_MIN_DRIVER)})")
  for note in c["notes"]:
    lines.append(f"  note      {note}")
  lines.append("")
  # One line per setting: the set ones first, the defaults after them.
  settings = sorted(r["settings"].items(), key=lambda kv: not kv[1]["set"])
  for i, (name, st) in enumerate(settings):
    state = f"ERROR: {st['error']}" if st["error"] else ("set" if st["set"] else "default")
    shown = os.environ.get(name, "") if st["error"] else ("(unset)" if st["value"] is None else st["value"])
    lines.append(f"{'settings' if i == 0 else '':<12}{name}={shown}  ({state})")
  for k, v in r["unknown_environment"].items():
    lines.append(f"  unknown   {k}={v}: not a gcmoe_jax setting (misspelt?), so it has no effect")
  for k, v in r["related_environment"].items():
    lines.append(f"  related   {k}={v}")
  return "\n".join(lines)
