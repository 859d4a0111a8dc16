"""Local-memory accesses inside the innermost loops of a role kernel (the mainloops), from its SASS.

    python docs/probes/sass_loops.py CUBIN_DIR/<variant key>/role2.cubin [...]   # needs cuobjdump on PATH

ptxas reports a kernel's spill bytes, not where the spilled values are reloaded; the build allows role 2 of the
two-CTA variants a few (`build._SPILL_BUDGET`), on the understanding that they are prologue values reloaded at item
and pass starts, not in a stage body (docs/kernels_v2.md). This reads the SASS (`cuobjdump -sass`, from the
registry's ``nvidia-cuda-cuobjdump`` wheel on a machine without the toolkit), takes every backward branch as a loop,
keeps the loops that hold no other, and prints for each its instructions, its MMAs and its LDL/STL, so that claim
is checked rather than assumed; the same for the loops with MMAs whose nested loops have none (a K loop with a
bounded poll in it, as `GCMOE_ABLATION=kbany`'s). No GPU is needed.
"""

from __future__ import annotations

import re
import subprocess
import sys

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_TARGET = re.compile(r"(0x[0-9a-f]+)\s*$")


def nested_in(loop: tuple[int, int], loops) -> list[tuple[int, int]]:
  """The loops of ``loops`` (start, end) that lie inside ``loop``, other than itself."""
  return [o for o in loops if loop[0] <= o[0] and o[1] <= loop[1] and o != loop]


def innermost_loops(sass: str, mma_level: bool = False) -> list[dict]:
  """The innermost loops of the SASS text of one kernel: start and end address, instructions, MMAs, local accesses.
  ``mma_level``: instead, the loops with MMAs none of whose nested loops has any (a K loop with a bounded poll
  inside it, which the innermost loops miss)."""
  ins = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]
  loops = []
  for addr, text in ins:
    m = _TARGET.search(text.strip()) if "BRA" in text else None
    if m and int(m.group(1), 16) < addr:
      loops.append((int(m.group(1), 16), addr))
  loops = sorted(set(loops))
  stats = {}
  for lo, hi in loops:
    body = [t for a, t in ins if lo <= a <= hi]
    stats[lo, hi] = {"start": lo, "end": hi, "instructions": len(body), "mma": sum("MMA" in t for t in body),
                     "local": sum(bool(re.search(r"\b(LDL|STL)", t)) for t in body)}
  if mma_level:
    return [stats[lp] for lp in loops if stats[lp]["mma"] and not any(stats[n]["mma"] for n in nested_in(lp, loops))]
  return [stats[lp] for lp in loops if not nested_in(lp, loops)]


def main(argv: list[str]) -> int:
  if not argv:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    return 2
  for path in argv:
    sass = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True, text=True).stdout
    loops = innermost_loops(sass)
    hot = [lp for lp in loops if lp["mma"]]
    mma_loops = innermost_loops(sass, mma_level=True)
    print(f"{path}: {len(loops)} innermost loops, {len(hot)} with MMAs; local accesses in them: "
          f"{sum(lp['local'] for lp in loops)} ({sum(lp['local'] for lp in hot)} in loops with MMAs); "
          f"{len(mma_loops)} innermost loops with MMAs counting the loops inside them: "
          f"{sum(lp['local'] for lp in mma_loops)} local accesses")
    for lp in {(lp["start"], lp["end"]): lp for lp in loops + mma_loops}.values():
      if lp["local"]:
        print(f"  {lp['start']:#x}-{lp['end']:#x}: {lp['instructions']} instructions, {lp['mma']} MMAs, "
              f"{lp['local']} LDL/STL")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
