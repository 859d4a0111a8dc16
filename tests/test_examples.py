"""The examples run as scripts: examples/decode.py decodes and reports tokens/s and the backend."""

import os
import pathlib
import re
import subprocess
import sys

import gcmoe_jax as gm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
  # The repository root on the path, so that the example imports this checkout whether or not it is installed.
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  return subprocess.run([sys.executable, str(ROOT / "examples" / "decode.py"), *args], check=False,
                        capture_output=True, text=True, env=env, timeout=300)


def test_decode_prints_tokens_per_second_and_backend():
  p = _run("--steps", "3", "--layers", "1")
  assert p.returncode == 0, p.stderr
  backend = gm.explain().backend
  assert re.search(r"decoded 3 steps x batch \d+ in [\d.]+ s .*: [\d.]+ tokens/s, backend " + backend, p.stdout)
  assert f"gcmoe_jax.moe: backend={backend!r} (requested 'auto')" in p.stdout
  assert re.search(r"first sequence: \[(\d+, ){6}\d+\]", p.stdout)  # prompt 4 + 3 generated


def test_decode_rejects_an_ep_that_does_not_divide_the_batch():
  p = _run("--ep", "3")
  assert p.returncode == 2
  assert "decode.py: --ep must be >= 1 and divide --batch = 4, got 3" in p.stderr


def test_decode_with_expert_parallelism_matches_one_device():
  """--ep 4 splits the experts and the batch over 4 host devices; greedy decoding must pick the same tokens."""
  one, four = _run("--steps", "3", "--layers", "1"), _run("--steps", "3", "--layers", "1", "--ep", "4")
  assert one.returncode == 0 and four.returncode == 0, four.stderr[-2000:]
  first = [line for line in one.stdout.splitlines() if line.startswith("first sequence")]
  assert first and first == [line for line in four.stdout.splitlines() if line.startswith("first sequence")]
  assert "expert parallel over 4 devices" in four.stdout
