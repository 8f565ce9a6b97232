"""Small helpers every page router shares: paging through a long table, and a 404 page."""

from __future__ import annotations

from dataclasses import dataclass


class PageNotFound(Exception):
    """The page names something that does not exist (answered by a 404 page)."""


@dataclass(frozen=True)
class Paging:
    """One page of a table: which rows, and the links to its neighbours."""

    page: int
    per_page: int
    total: int

    @property
    def skip(self) -> int:
        return (self.page - 1) * self.per_page

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))

    @property
    def has_prev(self) -> bool:
        return self.page > 1

    @property
    def has_next(self) -> bool:
        return self.page < self.pages
