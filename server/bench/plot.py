"""The sweep as a picture: tok/s vs k per prompt kind, the baseline as a line, acceptance on the
right axis. Uses matplotlib's object API with the Agg canvas: no pyplot, no display."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["error"] is None and r["tps_median"] is not None]


def plot_sweep(rows: list[dict], path: Path, *, title: str = "") -> Path:
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    # Fixed margins: constrained layout costs seconds on a small CPU for no visible gain here.
    n = max(len(kinds), 1)
    fig = Figure(figsize=(5.5 * n, 4.2))
    fig.subplots_adjust(left=0.02 + 0.1 / n, right=0.98 - 0.1 / n, bottom=0.13, top=0.86,
                        wspace=0.45)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=False):
        acc_ax = ax.twinx()
        ks = sorted({r["k"] for r in rows if r["kind"] == kind and r["k"] > 0})
        for i, server in enumerate(servers):
            mine = [r for r in _ok(rows) if r["kind"] == kind and r["server"] == server]
            _draw_server(ax, acc_ax, mine, color=f"C{i}", name=server if len(servers) > 1 else "")
        if ks:
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(kind)
        ax.set_xlabel("draft tokens per round (k)")
        ax.set_ylabel("generation tok/s (median, IQR)")
        acc_ax.set_ylabel("accepted / proposed")
        acc_ax.set_ylim(0, 1.05)
        handles = ax.get_legend_handles_labels()
        acc_handles = acc_ax.get_legend_handles_labels()
        if handles[0] or acc_handles[0]:
            acc_ax.legend(handles[0] + acc_handles[0], handles[1] + acc_handles[1],
                      fontsize="small", loc="best")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def _draw_server(ax, acc_ax, rows: list[dict], *, color: str, name: str) -> None:
    prefix = f"{name}: " if name else ""
    base = next((r for r in rows if r["k"] == 0), None)
    if base is not None:
        ax.axhline(base["tps_median"], color=color, linestyle="--", label=f"{prefix}baseline")
        ax.axhspan(base["tps_q1"], base["tps_q3"], color=color, alpha=0.12)
    spec = sorted((r for r in rows if r["k"] > 0), key=lambda r: r["k"])
    if not spec:
        return
    ks = [r["k"] for r in spec]
    med = [r["tps_median"] for r in spec]
    err = [[m - r["tps_q1"] for m, r in zip(med, spec, strict=True)],
           [r["tps_q3"] - m for m, r in zip(med, spec, strict=True)]]
    ax.errorbar(ks, med, yerr=err, color=color, marker="o", capsize=3,
                label=f"{prefix}speculative")
    acc = [(r["k"], r["accept_rate_median"]) for r in spec if r["accept_rate_median"] is not None]
    if acc:
        acc_ax.plot([k for k, _ in acc], [a for _, a in acc], color=color, marker="s",
                    linestyle=":", alpha=0.7, label=f"{prefix}acceptance")


def plot_load(rows: list[dict], path: Path, *, title: str = "") -> Path:
    """`server.bench.load`: aggregate and per-stream tok/s, and TTFT p50, vs concurrent streams."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig = Figure(figsize=(12, 4.2))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.13, top=0.86, wspace=0.3)
    panels = (("aggregate_tps", "aggregate output tok/s"),
              ("stream_tps_p50", "per-stream tok/s (p50)"), ("ttft_p50_s", "TTFT p50 (s)"))
    levels = sorted({r["concurrency"] for r in rows})
    for ax, (key, label) in zip(fig.subplots(1, len(panels)), panels, strict=True):
        for i, server in enumerate(servers):
            points = [(r["concurrency"], r[key]) for r in rows
                      if r["server"] == server and r[key] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), color=f"C{i}", marker="o", label=server)
        if levels:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)
