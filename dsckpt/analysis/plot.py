"""``--plot OUT.png``: a value per tensor, in model order, grouped by layer (matplotlib, an optional extra).

Readable at 100+ layers: with 8 layers or more, a heatmap of layer (x) by tensor role within the
layer (y, e.g. ``mlp_in.weight``), log colour scale, plus bars for tensors outside the layers
(embeddings, final norm, head); with fewer, one bar per tensor.  Non-finite values are marked red.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import MissingExtraError

LAYER = re.compile(r"^(.*?\.)?(?:layers?|blocks?|h|encoder\.layer|decoder\.layers?)\.(\d+)\.")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib, not installed",
                                hint="pip install 'dsckpt[plot]'") from None
    return plt


def layer_of(name: str) -> str | None:
    m = LAYER.match(name)
    return m.group(2) if m else None


def bar_plot(names: list[str], values: list[float], out: Path, *, title: str, ylabel: str) -> Path:
    """Per-tensor values in model order.  With many layers: a heatmap (layer x tensor role) beside the
    tensors outside layers; else bars.  Non-finite values are marked red."""
    plt = _pyplot()
    layered = [(layer_of(n), LAYER.sub("", n, count=1)) for n in names]
    layers = sorted({l for l, _ in layered if l is not None}, key=int)
    if len(layers) >= 8:
        _heatmap(plt, names, values, layered, layers, out, title=title, ylabel=ylabel)
    else:
        _bars(plt, names, values, out, title=title, ylabel=ylabel)
    return out


def _finite_positive(v: float | None) -> float:
    return v if v is not None and math.isfinite(v) and v > 0 else float("nan")


def _heatmap(plt, names, values, layered, layers, out: Path, *, title: str, ylabel: str) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm

    roles = list(dict.fromkeys(role for layer, role in layered if layer is not None))
    grid = np.full((len(roles), len(layers)), np.nan)
    bad = []
    col = {l: i for i, l in enumerate(layers)}
    row = {r: i for i, r in enumerate(roles)}
    outside = []
    for name, value, (layer, role) in zip(names, values, layered):
        if layer is None:
            outside.append((name, value))
            continue
        grid[row[role], col[layer]] = _finite_positive(value)
        if value is not None and not math.isfinite(value):
            bad.append((col[layer], row[role]))
    fig = plt.figure(figsize=(min(24, 6 + len(layers) * 0.16), 3 + 0.28 * len(roles) + 0.25 * len(outside)))
    grid_ax = fig.add_axes([0.22, 0.45, 0.70, 0.45])
    positive = grid[np.isfinite(grid)]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    image = grid_ax.imshow(grid, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
    grid_ax.set_yticks(range(len(roles)))
    grid_ax.set_yticklabels(roles, fontsize=7)
    every = max(1, len(layers) // 25)
    grid_ax.set_xticks(range(0, len(layers), every))
    grid_ax.set_xticklabels(layers[::every], fontsize=7)
    grid_ax.set_xlabel("layer")
    grid_ax.set_title(title)
    for x, y in bad:
        grid_ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    fig.colorbar(image, ax=grid_ax, fraction=0.03, pad=0.01).set_label(ylabel, fontsize=8)
    if outside:
        bar_ax = fig.add_axes([0.22, 0.06, 0.70, 0.28])
        bar_ax.barh(range(len(outside)), [_finite_positive(v) for _, v in outside], color="#3b6ea5")
        bar_ax.set_xscale("log")
        bar_ax.set_yticks(range(len(outside)))
        bar_ax.set_yticklabels([n for n, _ in outside], fontsize=7)
        bar_ax.invert_yaxis()
        bar_ax.set_title("tensors outside the layers", fontsize=9)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _bars(plt, names, values, out: Path, *, title: str, ylabel: str) -> None:
    fig, ax = plt.subplots(figsize=(min(24, max(8, len(names) / 6)), 5))
    ax.bar(range(len(names)), [_finite_positive(v) for v in values], width=0.9, color="#3b6ea5")
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=6)
    for x, v in enumerate(values):
        if v is not None and not math.isfinite(v):
            ax.axvline(x, color="red", linewidth=1)  # a non-finite value: flagged
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
