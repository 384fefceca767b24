"""Human renderings of statistics and diffs (the JSON forms are the records themselves)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: inspect renders tables without importing numpy)
    from .diff import DiffReport
    from .stats import TensorStats


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def render_stats(stats: list[TensorStats], top: int) -> str:
    bad = [s for s in stats if not s.finite]
    lines = [f"{len(stats)} tensors, {sum(s.count for s in stats):,} values; "
             f"{len(bad)} with NaN/Inf" + ("" if bad else " (all finite)")]
    header = f"  {'name':<44}{'kind':<11}{'norm':>11}{'min':>11}{'max':>11}{'mean':>11}{'std':>11}{'zeros':>7}"
    for s in bad:
        lines.append(f"  NON-FINITE {s.name}: {s.nan:,} NaN, {s.inf:,} Inf of {s.count:,}")
    lines.append(f"largest {min(top, len(stats))} by norm")
    lines.append(header)
    for s in sorted(stats, key=lambda s: -s.norm)[:top]:
        zeros = f"{100 * s.zeros / s.count:.0f}%" if s.count else "-"
        lines.append(f"  {s.name[:43]:<44}{s.kind:<11}{_num(s.norm):>11}{_num(s.min):>11}{_num(s.max):>11}"
                     f"{_num(s.mean):>11}{_num(s.std):>11}{zeros:>7}")
    return "\n".join(lines)


def render_diff(report: DiffReport, top: int = 20) -> str:
    differing = [t for t in report.tensors if not t.equal]
    lines = [("IDENTICAL" if report.identical else "DIFFERENT") +
             f": {len(report.tensors)} common tensors, {len(differing)} differ"
             + (f" beyond atol={report.tolerances[0]:g} rtol={report.tolerances[1]:g}" if report.tolerances != (0.0, 0.0) else "")]
    for label, names in (("only in A", report.only_a), ("only in B", report.only_b),
                         ("shape differs", report.mismatched), ("dtype differs", report.dtype_changed)):
        if names:
            lines.append(f"{label} ({len(names)}): " + ", ".join(names[:10]) + (" ..." if len(names) > 10 else ""))
    if differing:
        lines.append(f"  {'name':<48}{'max |a-b|':>12}{'rel L2':>12}  within")
        for t in sorted(differing, key=lambda t: -t.rel_l2)[:top]:
            lines.append(f"  {t.name[:47]:<48}{t.max_abs_diff:>12.4g}{t.rel_l2:>12.4g}  {'yes' if t.within else 'no'}")
    return "\n".join(lines)


def table(rows: list[tuple[str, ...]], widths: tuple[int, ...]) -> list[str]:
    """Indented columns at least ``widths`` wide, widened to the longest cell so a long tensor name never
    runs into the next column (two spaces between columns; a width of 0: the last, free column)."""
    if not rows:
        return []
    cols = [max(w, *(len(r[i]) + 2 for r in rows)) if w else 0 for i, w in enumerate(widths)]
    return ["  " + "".join(cell.ljust(w) if w else cell for cell, w in zip(r, cols)).rstrip() for r in rows]
