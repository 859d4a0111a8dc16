"""Where role 2's warps wait, per SASS instruction: ncu's source page (docs/probes/ncu_role2.sh with NCU_SOURCE=DIR).

    python docs/probes/sass_stalls.py DIR/role2_1_sass.csv [--loops 3] [--top 40]

ncu samples each scheduler's warps every 2**(5 + 3) cycles and books a sample on the instruction the warp is at,
with the reason it is not issuing (or "selected": issuing). The stall of a dependent instruction is booked on the
waiting one, so a sample at an MMA's consumer reads "the MMA's latency". This prints the samples by reason over
the whole kernel, then, for the loops with the most samples (backward branches, as `sass_loops.py` finds them), the
share per reason and the instructions holding the most samples with their top reasons, in program order.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

from sass_loops import nested_in  # (this folder: run as a script, or with it on sys.path)

_TARGET = re.compile(r"(0x[0-9a-f]+)\s*$")


def read(path: str) -> tuple[list[str], list[dict]]:
  """(stall reasons, rows): each row's address and branch target (ints relative to the kernel's first
  instruction; ncu prints both absolute), text, samples, executions and samples by reason."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
  cols = rows[head]
  reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
  at = {c: cols.index(c) for c in cols}
  out = []
  base = None
  for r in rows[head + 1:]:
    if len(r) < len(cols) or not r[0].startswith("0x"):
      continue
    addr = int(r[0], 16)
    base = addr if base is None else base
    num = lambda c: float(r[at[c]].replace(",", "") or 0)  # noqa: E731
    text = r[at["Source"]].strip()
    m = _TARGET.search(text) if "BRA" in text else None
    out.append({"addr": addr - base, "text": text, "target": int(m.group(1), 16) - base if m else None,
                "samples": num("Warp Stall Sampling (All Samples)"), "executed": num("Instructions Executed"),
                "by": {c[6:]: num(c) for c in reasons}})
  return [c[6:] for c in reasons], out


def loops(rows: list[dict]) -> list[tuple[int, int]]:
  """The innermost backward-branch ranges (start, end) of the kernel."""
  found = {(r["target"], r["addr"]) for r in rows if r["target"] is not None and 0 <= r["target"] < r["addr"]}
  return [lp for lp in sorted(found) if not nested_in(lp, found)]


def share(rows: list[dict], reasons: list[str]) -> str:
  tot = sum(r["samples"] for r in rows) or 1
  by = {k: sum(r["by"][k] for r in rows) for k in reasons}
  return ", ".join(f"{k} {100 * v / tot:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v / tot >= 0.01)


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
  ap.add_argument("csv")
  ap.add_argument("--loops", type=int, default=3, help="how many of the loops with the most samples to print")
  ap.add_argument("--top", type=int, default=40, help="instructions printed per loop (the most samples)")
  a = ap.parse_args(argv)
  reasons, rows = read(a.csv)
  total = sum(r["samples"] for r in rows)
  print(f"{a.csv}: {len(rows)} instructions, {total:.0f} samples; by reason (%): {share(rows, reasons)}")
  ranked = []
  for lo, hi in loops(rows):
    body = [r for r in rows if lo <= r["addr"] <= hi]
    ranked.append((sum(r["samples"] for r in body), lo, hi, body))
  ranked.sort(reverse=True)
  for s, lo, hi, body in ranked[:a.loops]:
    trips = max(r["executed"] for r in body)
    print(f"\nloop {lo:#x}-{hi:#x}: {len(body)} instructions, {100 * s / total:.1f} % of the samples, "
          f"{trips:.0f} warp executions of its busiest instruction; by reason (%): {share(body, reasons)}")
    keep = {id(r) for r in sorted(body, key=lambda r: -r["samples"])[:a.top]}
    for r in body:
      if id(r) in keep:
        top = sorted(r["by"].items(), key=lambda kv: -kv[1])[:3]
        why = ", ".join(f"{k} {v:.0f}" for k, v in top if v)
        print(f"  {r['addr']:#7x} {r['samples']:6.0f}  {r['text'][:60]:60s} {why}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
