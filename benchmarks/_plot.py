"""Every benchmark's table, saved as text and drawn as a plot beside it.

    save_table("train", setup_line, head, rows)   # runs/bench/train.txt and runs/bench/train.png

The folder is runs/bench/ in the repository (PARATRAIN_BENCH_OUT to choose another). The plot has
one horizontal bar chart per numeric column of the table, its rows labelled by their first
`label_columns` cells; a cell that is not a number ("failed", "-") is left out of that chart.
Needs matplotlib (the `bench` extra); without it only the text is saved.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

OUT = Path(os.environ.get("PARATRAIN_BENCH_OUT", Path(__file__).resolve().parents[1] / "runs" / "bench"))


def _number(cell: str) -> float | None:
    try:
        value = float(cell.replace(",", "").rstrip("x"))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def format_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(line[i])) for line in [head, *rows]) for i in range(len(head))]
    return [" | ".join(str(t).rjust(w) for t, w in zip(line, widths)) for line in [head, *rows]]


def save_table(
    name: str, title: str, head: Sequence[str], rows: Sequence[Sequence[str]], label_columns: int = 1
) -> None:
    """Write OUT/{name}.txt (title and table) and OUT/{name}.png (the table's numbers as bars)."""
    OUT.mkdir(parents=True, exist_ok=True)
    text = OUT / f"{name}.txt"
    text.write_text("\n".join([title, *format_table(head, rows)]) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"table saved to {text} (matplotlib is not installed: no plot)")
        return
    labels = [" ".join(str(c) for c in row[:label_columns]) for row in rows]
    columns = [
        i for i in range(label_columns, len(head)) if any(_number(str(row[i])) is not None for row in rows)
    ]
    if not columns:
        print(f"table saved to {text} (no numeric column to plot)")
        return
    cols = min(3, len(columns))
    lines = math.ceil(len(columns) / cols)
    fig, axes = plt.subplots(
        lines, cols, figsize=(4.2 * cols, 0.35 * len(rows) * lines + 1.6 * lines), squeeze=False
    )
    for ax in axes.flat[len(columns) :]:
        ax.axis("off")
    for ax, i in zip(axes.flat, columns):
        values = [_number(str(row[i])) for row in rows]
        ax.barh(range(len(rows)), [v or 0.0 for v in values], color="#4a89dc")
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(head[i], fontsize=9)
        for y, v in enumerate(values):
            ax.text(v or 0.0, y, f" {v:.3g}" if v is not None else " n/a", va="center", fontsize=7)
    fig.suptitle(title if len(title) < 140 else title[:137] + "...", fontsize=8)
    fig.tight_layout()
    picture = OUT / f"{name}.png"
    fig.savefig(picture, dpi=110)
    plt.close(fig)
    print(f"table saved to {text}, plot to {picture}")
