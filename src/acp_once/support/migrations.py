"""Numbered, append-only schema migrations, whatever the database.

`Migrations.steps[i]` takes a schema from version `i` to version `i + 1`. A released
migration is never edited: a schema change is a new step at the end. A database records the
versions it has had in a version table, one row per version. The runners that execute the
steps live with their drivers (`acp_once.support.sqlite.apply_migrations`, and the
PostgreSQL store's); what they share is here: the record, the latest version, which steps a
schema still needs, and what to say of a schema newer than the code.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Migration", "Migrations"]


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema change: single statements run in order, in the migrating transaction."""

    description: str
    statements: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Migrations:
    """A schema's migrations and the table that records the applied versions."""

    steps: tuple[Migration, ...]
    version_table: str

    @property
    def latest(self) -> int:
        """The schema version the code needs."""
        return len(self.steps)

    def pending(self, found: int, target: int | None = None) -> list[tuple[int, Migration]]:
        """The (version, migration) pairs that take a schema at `found` to `target` (the
        latest by default); none when it is there already.

        Raises:
            ValueError: `target` is not between 0 and the latest version.
        """
        if target is None:
            target = self.latest
        if not 0 <= target <= self.latest:
            raise ValueError(f"target must be between 0 and {self.latest}, got {target}")
        return [(v, self.steps[v - 1]) for v in range(found + 1, target + 1)]

    def too_new(self, found: int, where: str, what: str = "database") -> str | None:
        """The message for a schema at `found` that is newer than the code, or None."""
        if found <= self.latest:
            return None
        return (
            f"{where}: {what} schema version {found} is newer than this acp-once supports"
            f" ({self.latest}); upgrade acp-once"
        )
