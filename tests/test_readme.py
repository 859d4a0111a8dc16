"""The README's promises a newcomer relies on: its two commands (and `.ci/run` running exactly the second), and the
files it links."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _two_commands() -> list[str]:
  section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
  return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_two_commands_and_ci_runs_the_second():
  demo, tests = _two_commands()
  assert demo.endswith("-m gcmoe_jax demo") and demo.startswith("python3 -m pip install . && ")
  assert "'.[test]'" in tests and tests.endswith("-m pytest -q")
  ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
  assert ci[-1] == tests, (ci[-1], tests)


def test_linked_files_exist():
  links = set(re.findall(r"\]\(([^)#\s]+)\)", README)) | set(re.findall(r"`((?:docs|examples|\.ci)/[\w./-]+)`",
                                                                         README))
  assert len(links) >= 10  # the docs list, the plots, the example
  missing = sorted(p for p in links if not p.startswith("http") and not (ROOT / p).exists())
  assert missing == []
