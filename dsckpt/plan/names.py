"""Tensor names in a plan: prefixes stripped, ``--rename`` rules, tied names written out - every rename refuses two
tensors made one."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..errors import ConfigError, InconsistentCheckpointError
from ..formats import metadata as M

Plan = Any  # a plan.consolidate.Plan (not imported: consolidate strips prefixes through this module)


def prefixes(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """Name prefixes to strip: one string is one prefix (not its characters)."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def strip_name(name: str, prefixes: tuple[str, ...]) -> str:
    """``name`` without the first of ``prefixes`` it starts with (wrapper prefixes like ``module.``)."""
    for p in prefixes:
        if name.startswith(p):
            return name[len(p):]
    return name


def strip_prefix(plan: Plan, prefixes: tuple[str, ...]) -> Plan:
    return _with_names(plan, lambda name: strip_name(name, prefixes), f"stripping prefixes {list(prefixes)}",
                       "strip fewer prefixes (--strip-prefix)")


RenameRules = tuple[tuple[str, str], ...]


def rename_rules(value: Any) -> RenameRules:
    """``(pattern, replacement)`` pairs from ``{pattern: replacement}``, pairs, or ``"PATTERN=REPLACEMENT"``
    strings; each pattern a regular expression that must match a whole name (checked here)."""
    import re

    if isinstance(value, dict):
        pairs = list(value.items())
    else:
        pairs = []
        for item in ([value] if isinstance(value, str) else list(value or ())):
            if isinstance(item, str):
                if "=" not in item:
                    raise ConfigError(f"--rename {item!r}: expected PATTERN=REPLACEMENT")
                item = tuple(item.split("=", 1))
            pairs.append(item)
    for pattern, replacement in pairs:
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise ConfigError(f"rename {pattern!r} -> {replacement!r}: both must be strings")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"--rename {pattern!r}: not a regular expression ({exc})") from None
    return tuple(pairs)


def renamed(plan: Plan, rules: RenameRules) -> tuple[Plan, list[str]]:
    """Every name the first rule whose pattern matches it in full gives a new one (``\\1`` groups expand), the
    others kept; and the patterns that matched nothing."""
    import re

    compiled = [(re.compile(p), r) for p, r in rules]
    used: set[int] = set()

    def rename(name: str) -> str:
        for i, (pattern, replacement) in enumerate(compiled):
            match = pattern.fullmatch(name)
            if match:
                used.add(i)
                try:
                    return match.expand(replacement)
                except (re.error, IndexError) as exc:
                    raise ConfigError(f"--rename {pattern.pattern!r}={replacement!r}: {exc}") from None
        return name

    out = _with_names(plan, rename, "renaming", "make the --rename rules give distinct names")
    return out, [p for i, (p, _) in enumerate(rules) if i not in used]


def _with_names(plan: Plan, name_of: Callable[[str], str], what: str, hint: str) -> Plan:
    tensors = tuple(replace(t, name=name_of(t.name)) for t in plan.tensors)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InconsistentCheckpointError(f"{what} makes two tensors share the name {twice!r}", hint=hint)
    aliases = {name_of(a): name_of(s) for a, s in plan.aliases.items()}
    meta = {k: v for k, v in plan.metadata.items() if k != M.ALIASES}
    if aliases:
        import json
        meta[M.ALIASES] = json.dumps(aliases, sort_keys=True)
    return replace(plan, tensors=tensors, aliases=aliases, metadata=meta,
                   replicas=tuple(replace(r, name=name_of(r.name)) for r in plan.replicas))


def duplicate_aliases(plan: Plan) -> Plan:
    """Every tied name stored as a tensor of its own (what a strict ``load_state_dict`` of a file wants)."""
    by_name = {t.name: t for t in plan.tensors}
    extra = tuple(replace(by_name[s], name=a) for a, s in plan.aliases.items())
    meta = {k: v for k, v in plan.metadata.items() if k != M.ALIASES}
    return replace(plan, tensors=plan.tensors + extra, aliases={}, metadata=meta)
