"""`python -m gcmoe_jax bench ... --ab SETTING --ab SETTING [--rounds N]`: the same sweep under several settings of
the environment, alternating in one machine session.

Settings such as ``GCMOE_SOLO_SMS`` or ``GCMOE_GRAPH_CONTEXT`` are read once per process (some by the C++ runtime),
so each (setting, round) runs the sweep in a child process of its own, with the parent's arguments and the
setting's variables added to the environment. Rounds alternate the settings (A B A B ...), so that a drift of the
machine over the session falls on all of them alike; the first setting is the baseline of the report's changes.
A setting is a space-separated list of ``NAME=VALUE`` (empty: the environment as it is); a ``GCMOE_*`` or
``GC_MOE_*`` name must be a declared gcmoe_jax setting with a value it accepts (`gcmoe_jax._config`).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Sequence

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclasses.dataclass(frozen=True)
class Setting:
  """One column of an A/B run: the variables it sets, and how the report names it."""
  env: tuple[tuple[str, str], ...]

  @property
  def label(self) -> str:
    return " ".join(f"{k}={v}" for k, v in self.env) or "(as is)"


def parse_setting(text: str) -> Setting:
  """``"NAME=VALUE NAME=VALUE"`` -> `Setting`; a malformed assignment, an undeclared ``GCMOE_*``/``GC_MOE_*`` name or
  a value its parser refuses raises ValueError naming the argument."""
  from gcmoe_jax import _config

  env = []
  for part in text.split():
    name, eq, value = part.partition("=")
    if not eq or not _NAME.match(name):
      raise ValueError(f"bench: --ab {text!r}: expected space-separated NAME=VALUE assignments, got {part!r}")
    if name.startswith(("GCMOE_", "GC_MOE_")):
      var = _config.VARS.get(name)
      if var is None:
        raise ValueError(f"bench: --ab {text!r}: {name} is not a gcmoe_jax setting (python -m gcmoe_jax doctor lists "
                         f"them)")
      try:
        var.parse(value)
      except ValueError as e:
        raise ValueError(f"bench: --ab {text!r}: {name} must be {var.parse.__name__}, got {value!r}: {e}") from None
    if name in (k for k, _ in env):
      raise ValueError(f"bench: --ab {text!r}: {name} is set twice")
    env.append((name, value))
  return Setting(tuple(env))


@dataclasses.dataclass(frozen=True)
class Result:
  """One point of one child's sweep."""
  setting: int
  round: int
  impl: str
  batch: int
  latency_us: float
  min_us: float
  floor_us: float


def run(child_argv: Sequence[str], settings: Sequence[Setting], rounds: int, out: str, model: str) -> list[Result]:
  """Runs ``python -m gcmoe_jax bench *child_argv`` once per setting and round, alternating, each writing its CSV
  under ``out/ab/``; returns every point. A child that fails raises RuntimeError with the end of its output."""
  if len(settings) < 2:
    raise ValueError(f"bench: --ab needs at least two settings to compare, got {len(settings)}")
  if rounds < 1:
    raise ValueError(f"bench: --rounds must be >= 1, got {rounds}")
  results = []
  for r in range(rounds):
    for i, setting in enumerate(settings):
      where = os.path.join(out, "ab", f"s{i}_r{r}")
      env = dict(os.environ, **dict(setting.env))
      env.setdefault("PYTHONUNBUFFERED", "1")
      print(f"[ab] round {r + 1}/{rounds}, setting {i}: {setting.label}", file=sys.stderr, flush=True)
      start = time.monotonic()
      done = subprocess.run([sys.executable, "-m", "gcmoe_jax", "bench", *child_argv, "--out", where], env=env,
                            capture_output=True, text=True)
      if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"bench: --ab setting {i} ({setting.label}), round {r + 1}: the sweep exited with "
                           f"{done.returncode}:\n{tail}")
      print(f"[ab]   {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
      with open(os.path.join(where, f"bench_{model}.csv"), newline="") as f:
        for row in csv.DictReader(f):
          results.append(Result(i, r, row["impl"], int(row["batch"]), float(row["latency_us"]), float(row["min_us"]),
                                float(row["floor_us"])))
  return results


def to_markdown(results: Sequence[Result], settings: Sequence[Setting]) -> str:
  """A table per (impl, B): each setting's mean latency with its rounds, and its change against the first's."""
  head = ["impl", "B", *(f"{i}: {s.label}" for i, s in enumerate(settings))]
  lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
  points = sorted({(x.impl, x.batch) for x in results})
  for impl, batch in points:
    per = [[x.latency_us for x in results if (x.impl, x.batch, x.setting) == (impl, batch, i)]
           for i in range(len(settings))]
    means = [statistics.fmean(v) if v else math.nan for v in per]
    cells = []
    for i, (v, m) in enumerate(zip(per, means)):
      cell = f"{m:.1f} ({', '.join(f'{t:.1f}' for t in v)})"
      if i and means[0] > 0:  # a non-positive first mean is timing noise (see sweep.NOT_POSITIVE_NOTE): no ratio
        cell += f" **{100 * (m / means[0] - 1):+.1f} %**"
      cells.append(cell)
    lines.append(f"| {impl} | {batch} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_csv(results: Sequence[Result], settings: Sequence[Setting], path: str) -> None:
  """One line per point of every child: the setting (index and label), the round and the point's figures."""
  with open(path, "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(["setting", "env", "round", "impl", "batch", "latency_us", "min_us", "floor_us"])
    for x in results:
      out.writerow([x.setting, settings[x.setting].label, x.round, x.impl, x.batch, f"{x.latency_us:.6g}",
                    f"{x.min_us:.6g}", f"{x.floor_us:.6g}"])
