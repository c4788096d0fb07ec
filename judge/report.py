"""The judge's verdicts, table, JSON report and plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from judge.train import Result

REFERENCE = "hsdump"
# condition -> (what it trains on, the verdict rule against hsdump's records)
CONDITIONS = {
    "hsdump": ("hsdump regenerate + extract --format specforge (README)", "reference"),
    "anchor": ("the same conversations, SpecForge's own data path", "equal"),
    "shifted": ("hsdump's records, states one position late", "loses"),
    "layer0": ("hsdump's records, aux layers replaced by layer 0", "loses"),
    "original": ("the dataset's original answers (not regenerated)", "compare"),
    "drafted": ("hsdump's records with --loss-mask drafted", "compare"),
    "untrained": ("no training (learning rate 1e-30)", "loses"),
}


def summary(results: list[Result]) -> dict[str, dict]:
    """Per condition: seeds, mean, sample standard deviation, range of the measure."""
    out: dict[str, dict] = {}
    for name in CONDITIONS:
        xs = [r.simulated_acc_len for r in results if r.condition == name]
        if xs:
            out[name] = {"values": xs, "mean": statistics.fmean(xs),
                         "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                         "min": min(xs), "max": max(xs), "spread": max(xs) - min(xs)}
    return out


def verdicts(stats: dict[str, dict]) -> dict[str, str]:
    """Each condition against hsdump. The spread is the larger seed range (max - min) of the
    two: "equal" passes when the means differ by at most it, "loses" when the condition's mean
    is below hsdump's by more than it; "compare" states which is ahead and whether by more."""
    ref = stats.get(REFERENCE)
    out = {}
    for name, s in stats.items():
        rule = CONDITIONS[name][1]
        if name == REFERENCE or ref is None:
            out[name] = "reference" if name == REFERENCE else "no reference"
            continue
        spread, diff = max(ref["spread"], s["spread"]), s["mean"] - ref["mean"]
        if rule == "equal":
            out[name] = ("PASS: equal within the spread" if abs(diff) <= spread
                         else "FAIL: differs by more than the spread")
        elif rule == "loses":
            out[name] = ("PASS: loses by more than the spread" if -diff > spread
                         else "FAIL: does not lose by more than the spread")
        else:
            ahead = "ahead of" if diff > 0 else "behind"
            beyond = "more" if abs(diff) > spread else "no more"
            out[name] = f"{ahead} hsdump by {beyond} than the spread"
    return out


def table(stats: dict[str, dict], verdict: dict[str, str]) -> str:
    """The verdict table (plain text)."""
    rows = [("condition", "trains on", "seeds", "simulated acc len (mean +- sd)", "min-max",
             "verdict vs hsdump")]
    for name, s in stats.items():
        rows.append((name, CONDITIONS[name][0], str(len(s["values"])),
                     f"{s['mean']:.3f} +- {s['sd']:.3f}", f"{s['min']:.3f}-{s['max']:.3f}",
                     verdict[name]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def plot(stats: dict[str, dict], path: Path, title: str) -> None:
    """Bars of the mean per condition, min-max whiskers, each seed a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(stats)
    means = [stats[n]["mean"] for n in names]
    err = [[stats[n]["mean"] - stats[n]["min"] for n in names],
           [stats[n]["max"] - stats[n]["mean"] for n in names]]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar(names, means, yerr=err, capsize=4, color="#8fb3d9", edgecolor="#2f5d8a")
    for i, n in enumerate(names):
        ax.scatter([i] * len(stats[n]["values"]), stats[n]["values"], color="#1b3550", s=12,
                   zorder=3)
    ax.set_ylabel("SpecForge eval/simulated_acc_len\n(held-out records)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(path: Path, report: dict) -> None:
    """The JSON report, written whole or not at all."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
