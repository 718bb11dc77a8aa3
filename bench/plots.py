"""The dashboard's plots, drawn from the figures recorded in bench/RESULTS.md (no benchmark is re-run):

    python bench/plots.py [--results bench/RESULTS.md] [--out docs/img]

- decode_vs_batch.png: decode tokens/s against batch, final against llama.cpp (same weights) and against HF
  `generate` (each panel one machine and date, as recorded);
- cartridge_kl.png: held-out KL (/ the document's first 64 tokens) against training steps, per cartridge method;
- tool_call_rate.png: GSM8K tool-call rate per tool-use cartridge recipe.
Tables are found by their header row, so a table that moves within RESULTS.md is still found; one that is gone is
an error naming it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in text, as rows of cells (header first, the |---| line dropped)."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            found.append(rows)
            rows = []
    return found


def clean(cell: str) -> str:
    return re.sub(r"[*`]", "", cell).strip()


def number(cell: str) -> float:
    return float(re.search(r"-?\d+(?:\.\d+)?", clean(cell)).group())


def find(all_tables, *header_starts: str) -> list[list[list[str]]]:
    """The tables whose first header cell starts with one of header_starts."""
    hits = [t for t in all_tables if any(clean(t[0][0]).startswith(h) for h in header_starts)]
    if not hits:
        raise SystemExit(f"bench/plots.py: no table headed {header_starts!r} in RESULTS.md")
    return hits


def decode_plot(all_tables, out: Path, plt) -> None:
    peer = find(all_tables, "ours")[0]
    hf = find(all_tables, "dtype")[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in peer[1:]:
        ours, theirs = (number(x) for x in row[3].split("/"))
        batch = int(number(row[2]))
        series.setdefault(f"final {clean(row[0])}", []).append((batch, ours))
        series.setdefault(f"llama.cpp {clean(row[1])}", []).append((batch, theirs))
    for name, points in series.items():
        left.plot(*zip(*sorted(points)), marker="o", linestyle="-" if name.startswith("final") else "--", label=name)
    left.set(title="vs llama.cpp, same weights (2-core AMD EPYC, 2026-11-27)", xlabel="batch", ylabel="decode tokens/s")
    series = {}
    for row in hf[1:]:
        batch = int(number(row[1]))
        series.setdefault(f"final {row[0]}", []).append((batch, number(row[2])))
        series.setdefault(f"HF generate {row[0]}", []).append((batch, number(row[3])))
    for name, points in series.items():
        right.plot(*zip(*sorted(points)), marker="o", linestyle="-" if name.startswith("final") else "--", label=name)
    right.set(title="vs HF generate (2-core Sapphire Rapids, 2026-11-22)", xlabel="batch", ylabel="tokens/s")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "decode_vs_batch.png", dpi=110)
    plt.close(fig)


def kl_plot(all_tables, out: Path, plt) -> None:
    runs: dict[str, list[tuple[int, float]]] = {}
    for table in find(all_tables, "run"):
        header = [clean(c) for c in table[0]]
        if "step" not in header or "cartridge / first 64" not in header:
            continue
        step_at, ratio_at = header.index("step"), header.index("cartridge / first 64")
        label = re.sub(r"^run ?", "", header[0]).strip("() ")
        for row in table[1:]:
            name = clean(row[0])
            if row[step_at] == "OUT" or "constant" in name or "OUT" in name:
                continue
            point = (int(row[step_at]), number(row[ratio_at]))
            runs.setdefault(f"{name} [{label}]" if label else name, []).append(point)
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for name, points in runs.items():
        if name.startswith(("on (F=1)", "off (F=0)")):  # the fourth pass's runs start from the prefix: 1.00x
            points, name = [(0, 1.0)] + points, f"prefix, {name}"
        ax.plot(*zip(*sorted(points)), marker="o", label=name)
    ax.set(title="Held-out KL of a p=64 cartridge during training (SmolLM2-135M, 2-core AMD EPYC)",
           xlabel="training steps", ylabel="held-out KL / the document's first 64 tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    fig.savefig(out / "cartridge_kl.png", dpi=110)
    plt.close(fig)


def tool_plot(all_tables, out: Path, plt) -> None:
    table = find(all_tables, "SmolLM2-135M-Instruct, first 200 GSM8K")[0]
    rate_at = [clean(c) for c in table[0]].index("tool-call rate")
    names = [clean(r[0]) for r in table[1:]]
    rates = [number(r[rate_at]) for r in table[1:]]
    fig, ax = plt.subplots(figsize=(10, 4))
    bars = ax.barh(range(len(names)), rates)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set(xlim=(0, 1.1), xlabel="tool-call rate, first 200 GSM8K test problems")
    fig.suptitle("Tool-use cartridges for SmolLM2-135M-Instruct (2-core AMD EPYC, 2026-11-26)")
    fig.tight_layout()
    fig.savefig(out / "tool_call_rate.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_tables = tables(args.results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for plot in (decode_plot, kl_plot, tool_plot):
        plot(all_tables, args.out, plt)
    print(f"wrote {', '.join(sorted(p.name for p in args.out.glob('*.png')))} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
