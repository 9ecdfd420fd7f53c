"""The table printed at the end of a sweep."""

from __future__ import annotations


def num(value, fmt: str, missing: str = "-") -> str:
    """`value` formatted with `fmt`, or `missing` when there is none."""
    return missing if value is None else format(value, fmt)


def aligned(lines: list[list], *, rule: bool = True) -> str:
    """Rows of cells (the first the header) as left-aligned columns two spaces apart, with a
    dashed rule under the header unless `rule` is False."""
    cells = [[str(c) for c in line] for line in lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in cells]
    if rule:
        text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def _tps(row: dict) -> str:
    if row["tps_median"] is None:
        return "-"
    return f"{row['tps_median']:.1f} [{row['tps_iqr']:.1f}]"


def _acceptance(row: dict) -> str:
    if not row["k"] or row["proposed"] is None:
        return "-"
    rate = num(row["accept_rate_median"], ".3f", "n/a")
    return f"{row['accepted']}/{row['proposed']} {rate}"


def format_table(rows: list[dict]) -> str:
    compare = any(r["compare_ratio"] is not None or r["compare_with"] for r in rows)
    servers = len({r["server"] for r in rows}) > 1
    header = (["server"] if servers else []) + [
        "kind", "k", "tok/s median [IQR]", "speedup", "theory", "accepted/proposed",
        "from_draft", "peak GB", "flag",
    ] + (["ratio"] if compare else [])
    lines = [header]
    for r in rows:
        if r["error"] is not None:
            flag = f"ERROR {r['error'][:60]}"
        else:
            flag = "CV>0.10" if r["flagged"] else ""
        line = ([r["server"]] if servers else []) + [
            r["kind"], "base" if r["k"] == 0 else str(r["k"]), _tps(r),
            num(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else ""),
            num(r["theory"], ".2f") + ("x" if r["theory"] is not None else ""),
            _acceptance(r), num(r["from_draft_median"], ".3f") if r["k"] else "-",
            num(r["peak_gb_median"], ".3f"), flag,
        ]
        if compare:
            line.append(num(r["compare_ratio"], ".2f"))
        lines.append(line)
    return aligned(lines)
