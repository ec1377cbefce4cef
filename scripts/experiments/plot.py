#!/usr/bin/python3
"""Plots and markdown tables from the JSON results of the experiment drivers.

    /usr/bin/python3 scripts/experiments/plot.py copy_heatmap runs/copy_heatmap/copy_heatmap.json
    /usr/bin/python3 scripts/experiments/plot.py digits runs/digits/digits.json

copy_heatmap: copy_heatmap.png (one accuracy heatmap per method: length x
clusters or rounds, full attention as a one-column reference) and
copy_heatmap.md (the same numbers as tables). digits: digits.png (bits/dim
and images/s per method), digits_samples.png (the sampled images) and
digits.md. Files are written next to the JSON file. Needs Debian's
python3-matplotlib (scripts/install_experiment_deps.sh).
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def heat(ax, rows, cols, values, title, xlabel, ylabel=True):
    grid = [[values.get((r, c)) for c in cols] for r in rows]
    shown = [[float("nan") if v is None else v for v in row] for row in grid]
    im = ax.imshow(shown, vmin=0, vmax=1, cmap="viridis", origin="lower", aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel("sequence length")
    ax.set_title(title)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is not None:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center",
                        color="black" if v > 0.6 else "white", fontsize=8)
    return im


def table(rows, cols, values, corner):
    out = ["| " + corner + " | " + " | ".join(str(c) for c in cols) + " |",
           "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        cells = [("" if values.get((r, c)) is None else f"{values[(r, c)]:.3f}") for c in cols]
        out.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def copy_heatmap(data, base):
    recs = data["records"]
    lengths = sorted({r["sequence_length"] for r in recs})
    panels = [("improved-clustered", "clusters", "i-clustered"),
              ("clustered", "clusters", "clustered"),
              ("reformer", "rounds", "reformer (lsh)")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4), gridspec_kw={"width_ratios": [4, 4, 4, 1]})
    md = [f"# Masked copy: accuracy on the masked positions"
          f"{' (--quick run)' if data.get('quick') else ''}", ""]
    im = None
    for ax, (method, key, title) in zip(axes, panels):
        sel = [r for r in recs if r["method"] == method]
        cols = sorted({r[key] for r in sel})
        values = {(r["sequence_length"], r[key]): r["accuracy"] for r in sel}
        im = heat(ax, lengths, cols, values, title, key, ylabel=ax is axes[0])
        md += [f"## {title}", "", table(lengths, cols, values, f"length \\ {key}"), ""]
    full = {(r["sequence_length"], "full"): r["accuracy"] for r in recs if r["method"] == "full"}
    heat(axes[3], lengths, ["full"], full, "full", "", ylabel=False)
    md += ["## full (reference)", "", table(lengths, ["full"], full, "length"), ""]
    fig.colorbar(im, ax=axes.tolist(), shrink=0.8, label="accuracy")
    fig.savefig(base + ".png", dpi=100, bbox_inches="tight")
    secs = sum(r["train_seconds"] for r in recs)
    steps = {}  # sequence length -> the step counts of its runs
    for r in recs:
        steps.setdefault(r["sequence_length"], set()).add(r["steps"])
    budget = ", ".join(f"{'/'.join(map(str, sorted(s)))} at {n}" for n, s in sorted(steps.items()))
    md += [f"{len(recs)} runs, {secs / 60:.1f} minutes of training, steps per run by sequence "
           f"length: {budget}; {recs[0]['threads'] if recs else 0} threads per run. "
           f"Sequence length = 2 x length + 2.", ""]
    open(base + ".md", "w").write("\n".join(md))


def read_pgm(path):
    raw = open(path, "rb").read()
    parts = raw.split(b"\n", 3)
    assert parts[0] == b"P5", path
    w, h = (int(x) for x in parts[1].split())
    maxval = int(parts[2])
    pix = parts[3][: w * h]
    return [[pix[y * w + x] / maxval for x in range(w)] for y in range(h)]


def digits(data, base):
    recs = data["records"]
    names = [r["method"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(recs))
    best = [r.get("best_bits_per_dim", r["bits_per_dim"]) for r in recs]
    a.bar([i - 0.2 for i in x], best, width=0.4, color="tab:blue", label="best evaluation")
    a.bar([i + 0.2 for i in x], [r["bits_per_dim"] for r in recs], width=0.4,
          color="tab:gray", label="end of the budget")
    a.set_xticks(list(x), names)
    a.legend(fontsize=8)
    a.set_ylabel("bits / dim (held-out, lower is better)")
    a.set_title(f"after {data['time_budget']:.0f} s of training each")
    b.bar([i - 0.2 for i in x], [r["images_per_second"] for r in recs], width=0.4,
          label="recurrent form (where available)")
    b.bar([i + 0.2 for i in x], [r["images_per_second_batch_form"] for r in recs], width=0.4,
          label="batch model re-run per pixel")
    b.set_xticks(list(x), names)
    b.set_ylabel("images / s")
    b.set_yscale("log")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.savefig(base + ".png", dpi=100, bbox_inches="tight")

    fig, axes = plt.subplots(len(recs), 1, figsize=(8, 2.2 * len(recs)))
    root = os.path.dirname(base)
    for ax, r in zip(axes if len(recs) > 1 else [axes], recs):
        ax.imshow(read_pgm(os.path.join(root, r["samples_pgm"])), cmap="gray", vmin=0, vmax=1)
        ax.set_title(r["method"], fontsize=9)
        ax.axis("off")
    fig.savefig(base + "_samples.png", dpi=100, bbox_inches="tight")

    md = [f"# Digits generation{' (--quick run)' if data.get('quick') else ''}", "",
          "| attention | bits/dim, best (at step) | bits/dim, end | steps in the budget | "
          "images/s | form | images/s, batch re-run |",
          "|---|---|---|---|---|---|---|"]
    for r in recs:
        best = r.get("best_bits_per_dim", r["bits_per_dim"])
        md.append(f"| {r['method']} | {best:.3f} ({r.get('best_step', r['steps'])}) | "
                  f"{r['bits_per_dim']:.3f} | {r['steps']} | "
                  f"{r['images_per_second']:.1f} | "
                  f"{'recurrent' if r['recurrent'] else 'batch re-run'} | "
                  f"{r['images_per_second_batch_form']:.1f} |")
    md += ["", f"Training time per model: {data['time_budget']:.0f} s; "
           f"{recs[0]['samples'] if recs else 0} images sampled; "
           f"{recs[0]['threads'] if recs else 0} threads.", ""]
    open(base + ".md", "w").write("\n".join(md))


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("copy_heatmap", "digits"):
        sys.exit(__doc__)
    kind, path = sys.argv[1], sys.argv[2]
    data = json.load(open(path))
    base = os.path.splitext(path)[0]
    (copy_heatmap if kind == "copy_heatmap" else digits)(data, base)
    print(f"wrote {base}.png and {base}.md")


if __name__ == "__main__":
    main()
