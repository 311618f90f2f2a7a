"""The paper's figures from the benchmark's JSON lines: normalized throughput per workload and configuration
(Figure 5 / 8c style) and achieved vs optimal cache hit rate (Figure 13 style)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; CI has no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def throughput_figure(rows: list[dict], path: str, title: str) -> None:
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by = {(r["workload"], r["config"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(workloads)), 4.5))
    width = 0.8 / len(configs)
    x = np.arange(len(workloads))
    for i, c in enumerate(configs):
        values = []
        for w in workloads:
            r, full = by.get((w, c)), by.get((w, "full"))
            values.append(r["programs_per_s"] / full["programs_per_s"] if r and full else 0.0)
        ax.bar(x + (i - (len(configs) - 1) / 2) * width, values, width, label=c)
    ax.set_xticks(x, workloads, rotation=30, ha="right")
    ax.set_ylabel("throughput / full sgjax")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hit_rate_figure(rows: list[dict], path: str, title: str) -> None:
    points = [r for r in rows if r.get("optimal_hit_rate") is not None and r.get("hit_rate") is not None]
    fig, ax = plt.subplots(figsize=(5, 5))
    for c in dict.fromkeys(r["config"] for r in points):
        sel = [r for r in points if r["config"] == c]
        ax.scatter([r["optimal_hit_rate"] for r in sel], [r["hit_rate"] for r in sel], label=c, s=18)
    ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8)
    ax.set_xlabel("optimal hit rate (Theorem 3.1)")
    ax.set_ylabel("achieved hit rate")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
