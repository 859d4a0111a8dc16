"""Command line: ``python -m gcmoe_jax <command> ...``.

Each command lives in ``gcmoe_jax/commands/<name>.py`` and exposes ``register(subparsers)``, which adds its parser
and sets ``func`` (a callable taking the parsed args and returning an exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("demo", "plan", "doctor", "bench", "accuracy", "build-kernels")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m gcmoe_jax", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
  for name in COMMANDS:
    try:
      module = importlib.import_module(f"gcmoe_jax.commands.{name.replace('-', '_')}")
    except ModuleNotFoundError as e:
      if e.name != f"gcmoe_jax.commands.{name.replace('-', '_')}":
        raise
      continue
    module.register(sub)
  args = parser.parse_args(argv)
  return int(args.func(args) or 0)


if __name__ == "__main__":
  sys.exit(main())
