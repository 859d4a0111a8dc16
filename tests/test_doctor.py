"""``python -m gcmoe_jax doctor`` on a CPU machine, and its CUDA probe against a stand-in driver module."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import jax
import pytest

from gcmoe_jax import _config, ffi
from gcmoe_jax.__main__ import main
from gcmoe_jax.commands import doctor
from gcmoe_jax.ffi import _library


def test_report_on_cpu(capsys, monkeypatch):
  monkeypatch.setenv("GCMOE_DOCTOR_TEST", "42")
  rc = main(["doctor"])
  out = capsys.readouterr().out
  support = ffi.platform_support("cpu")
  assert rc == (0 if support.ok else 1)
  assert f"jax         {jax.__version__}" in out
  assert f"backend cpu  {'usable' if support.ok else 'unavailable'}" in out and support.reason in out
  assert "backend cuda unavailable needs a CUDA GPU, and the default device is cpu" in out
  assert "default backend cpu" in out
  assert "GCMOE_DOCTOR_TEST=42" in out
  info = ffi.library_info()
  if info.path:
    # The label names every target the library declares for the platform, the sync-check one too.
    assert info.path in out and f"{ffi.TARGET}, {ffi.TARGET_SYNC} on cpu: registered" in out


def test_settings_listed_and_misspelt_or_malformed_ones_named(capsys, monkeypatch):
  """Every declared setting gets a line with its value; a set GCMOE_* variable gcmoe_jax does not read (a misspelt
  setting, which otherwise has no effect) and a malformed value are named, not raised."""
  monkeypatch.setenv("GCMOE_SOLO_SM", "all")  # misspelt GCMOE_SOLO_SMS
  monkeypatch.setenv("GCMOE_KERNELS", "v3")
  monkeypatch.setenv("GCMOE_WAIT_TIMEOUT_MS", "5000")
  monkeypatch.setenv("GCMOE_DEBUG_TRACE", "true")  # the C++ runtime reads exactly "1": "true" would mean off
  monkeypatch.delenv("GCMOE_SOLO_SMS", raising=False)
  monkeypatch.delenv("GC_MOE_SM120_DISPATCH_SMS", raising=False)
  main(["doctor"])
  out = capsys.readouterr().out
  for name in _config.VARS:
    assert f"{name}=" in out, name
  assert "GCMOE_WAIT_TIMEOUT_MS=5000  (set)" in out
  assert f"GCMOE_SOLO_SMS={_config.VARS['GCMOE_SOLO_SMS'].default}  (default)" in out
  assert "GC_MOE_SM120_DISPATCH_SMS=(unset)  (default)" in out
  assert "GCMOE_KERNELS=v3  (ERROR: gcmoe_jax: environment variable GCMOE_KERNELS must be v1 or v2, got 'v3'" in out
  assert "GCMOE_DEBUG_TRACE=true  (ERROR:" in out and "must be 0 or 1" in out
  assert "unknown   GCMOE_SOLO_SM=all: not a gcmoe_jax setting (misspelt?)" in out
  main(["doctor", "--json"])
  report = json.loads(capsys.readouterr().out)
  assert report["settings"]["GCMOE_WAIT_TIMEOUT_MS"] == {"value": 5000, "set": True, "error": None,
                                                        "help": _config.VARS["GCMOE_WAIT_TIMEOUT_MS"].help}
  assert report["settings"]["GCMOE_KERNELS"]["value"] is None and "v1 or v2" in report["settings"]["GCMOE_KERNELS"][
    "error"]
  assert report["unknown_environment"] == {"GCMOE_SOLO_SM": "all"}


def test_every_variable_the_code_reads_is_declared():
  """The C++ runtime's getenv calls and the package's GCMOE_* reads all name a declared `_config.VARS` entry, so
  doctor and `_config`'s help cover every one (the package reads the rest through `_config.get`)."""
  root = Path(__file__).resolve().parents[1]
  read = set()
  for path in sorted((root / "csrc").glob("*.cc")) + sorted((root / "csrc").glob("*.h")):
    read |= set(re.findall(r'getenv\("([A-Z0-9_]+)"\)', path.read_text()))
  for path in sorted((root / "gcmoe_jax").rglob("*.py")):
    text = path.read_text()
    read |= set(re.findall(r'environ(?:\.get\(|\[)"((?:GCMOE|GC_MOE)_[A-Z0-9_]+)"', text))
    read |= set(re.findall(r'_config\.get\("([A-Z0-9_]+)"\)', text))
  assert {"GCMOE_DEBUG_TRACE", "GCMOE_DEBUG_PRIMARY_CTX", "GCMOE_SOLO_SMS"} <= read  # the scan finds both kinds
  assert read - set(_config.VARS) == set()


def test_json_report(capsys):
  main(["doctor", "--json"])
  report = json.loads(capsys.readouterr().out)
  assert report["jax"] == jax.__version__
  assert report["handlers"]["cuda"] == {"ok": False, "reason": "needs a CUDA GPU, and the default device is cpu"}
  assert report["handlers"]["cpu"]["ok"] == ffi.platform_support("cpu").ok
  assert report["devices"]["default_backend"] == "cpu"
  assert report["library"]["path"] == ffi.library_info().path


def test_exit_status_when_the_library_cannot_load(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(_library, "_STATE", _library._State())
  monkeypatch.setenv(_library.ENV_LIBRARY, str(tmp_path / "nowhere.so"))
  assert main(["doctor"]) == 1
  out = capsys.readouterr().out
  assert "library     not loaded" in out and "is not a loadable library" in out


def _fake_driver(version: int, *, init_error: Exception | None = None, green: bool = True):
  """A stand-in for cuda.bindings.driver: one SM120 GPU with 188 SMs."""
  ok = 0
  attrs = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
                                CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
                                CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sms")

  def cu_init(flags):
    if init_error is not None:
      raise init_error
    return (ok,)

  values = {"major": 12, "minor": 0, "sms": 188}
  d = types.SimpleNamespace(
    CUresult=types.SimpleNamespace(CUDA_SUCCESS=ok), CUdevice_attribute=attrs, cuInit=cu_init,
    cuDriverGetVersion=lambda: (ok, version), cuDeviceGetCount=lambda: (ok, 1), cuDeviceGet=lambda i: (ok, i),
    cuDeviceGetAttribute=lambda attr, dev: (ok, values[attr]),
    cuDeviceGetName=lambda n, dev: (ok, b"NVIDIA RTX PRO 6000 Blackwell\0\0\0"))
  if green:
    d.cuGreenCtxCreate = object()
  return d


@pytest.mark.parametrize("version, green, workqueue",
                         [(13010, True, True), (12080, True, False), (12030, False, False)])
def test_cuda_probe_with_a_gpu(version, green, workqueue):
  c = doctor.probe_cuda(_fake_driver(version))
  assert c["driver_version"] == version and c["source"] == "cuda.bindings.driver"
  assert c["gpus"] == [{"index": 0, "name": "NVIDIA RTX PRO 6000 Blackwell", "compute_capability": "12.0",
                        "sms": 188}]
  assert c["green_contexts"] is green and c["workqueue_split"] is workqueue
  text = doctor.format_report({**doctor.collect(), "cuda": c})
  assert "compute capability 12.0, 188 SMs" in text
  assert ("green ctx   supported" if green else "green ctx   NOT supported") in text


def test_cuda_probe_binding_without_green_contexts():
  assert doctor.probe_cuda(_fake_driver(12080, green=False))["green_contexts"] is False


def test_cuda_probe_without_a_driver_reports_instead_of_raising():
  c = doctor.probe_cuda(_fake_driver(0, init_error=RuntimeError("libcuda.so.1 not found")))
  assert c["gpus"] == [] or all(g["sms"] is None for g in c["gpus"])
  assert any("libcuda.so.1 not found" in n for n in c["notes"])
