"""`Support`: a capability probe's answer, with the reason (leaf module)."""

from __future__ import annotations

from typing import NamedTuple


class Support(NamedTuple):
  """Whether something can run here, and why (or why not), in one sentence."""

  ok: bool
  reason: str

  def __bool__(self) -> bool:  # `if support:` reads naturally
    return self.ok
