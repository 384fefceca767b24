"""Named plug-ins of one kind (output formats, convert targets): the built-in modules are imported on first use
and each registers itself; a user's plug-in is added beside them, and a name already taken is refused unless
``replace``."""
from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Plugins(Generic[T]):
    def __init__(self, kind: str, package: str, builtins: tuple[str, ...]):
        self.kind, self.package, self.builtins = kind, package, builtins
        self._items: dict[str, T] = {}
        self._loading = False  # True once the built-ins' import began (their own register() calls re-enter)

    def register(self, item: T, replace: bool = False) -> T:
        self._load_builtins()
        name = item.name  # type: ignore[attr-defined]
        if name in self._items and self._items[name] is not item and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (replace=True replaces it)")
        self._items[name] = item
        return item

    def all(self) -> dict[str, T]:
        """Every registered plug-in by name, built-ins first."""
        self._load_builtins()
        return self._items

    def _load_builtins(self) -> None:
        if self._loading:
            return
        self._loading = True
        for module in self.builtins:
            importlib.import_module(f"{self.package}.{module}")
