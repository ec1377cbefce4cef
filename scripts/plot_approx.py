#!/usr/bin/python3
"""Plots `fastattn approx --json FILE` over the number of clusters k: mean and
worst cosine to full attention and the top-k neighbour overlap, for clustered
and improved-clustered; other types as horizontal lines.

    /usr/bin/python3 scripts/plot_approx.py approx.json approx.png

Needs matplotlib (Debian: apt-get install python3-matplotlib; `make approx`
installs it).
"""
import json
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot_approx.py: matplotlib is missing (apt-get install python3-matplotlib)")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        report = json.load(f)
    series, flat = {}, []
    for r in report["results"]:
        k = r["params"].get("clusters")
        if r["type"] in ("clustered", "improved-clustered") and k is not None:
            name = r["type"] if r["type"] == "clustered" else \
                f"improved-clustered (topk={r['params'].get('topk')})"
            series.setdefault(name, []).append((k, r))
        elif r["type"] != "full":
            flat.append(r)
    metrics = [("mean_cosine", "mean cosine to full"), ("min_cosine", "worst cosine to full"),
               ("knn_overlap", f"top-{report['neighbours']} neighbour overlap")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, metrics):
        for name, pts in sorted(series.items()):
            pts.sort(key=lambda p: p[0])
            ax.plot([p[0] for p in pts], [p[1][key] for p in pts], marker="o", label=name)
        for i, r in enumerate(flat):
            ax.axhline(r[key], linestyle="--", color=f"C{i + 2}", label=r["label"])
        ax.set_xscale("log")
        ks = sorted({p[0] for pts in series.values() for p in pts})
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("clusters k")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"all-MiniLM-L6-v2 without fine-tuning: {report['passages']} Debian descriptions, "
                 f"mean {report['tokens'] / report['passages']:.0f} tokens (max {report['max_tokens']})")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
