"""What a backend's ``verify_service`` found for one service: its problems, and whether any of its parts was found at
all (a service of which nothing is held is ``missing``; one partly held is ``different``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Findings:
    """Problems and a count of the parts found, in the order they were checked."""

    problems: list[str] = field(default_factory=list)
    found: int = 0

    def check(self, what: str, held: Any, wanted: Any) -> None:
        """One part: ``held`` None is missing; a held part counts as found, and differs when it is not ``wanted``."""
        if held is None:
            self.problems.append(f"{what} missing")
            return
        self.found += 1
        if held != wanted:
            self.problems.append(f"{what} is {held!r}, wanted {wanted!r}")

    def verdict(self, most: int = 5) -> str | None:
        """None when nothing is wrong; ``missing`` when no part was found; else ``different:`` and the first
        ``most`` problems."""
        if not self.problems:
            return None
        return "missing" if not self.found else "different: " + "; ".join(self.problems[:most])
