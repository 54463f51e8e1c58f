#!/usr/bin/env python
"""Training curves of one or more runs, overlaid, in one PNG (needs matplotlib: pip install -e .[plot]).

    python tools/plot_metrics.py output/gpt2_pretrain                       # -> output/gpt2_pretrain/metrics.png
    python tools/plot_metrics.py output/run_a output/run_b -o compare.png   # two runs overlaid

Each OUTPUT_DIR's metrics.json (one JSON row per logged step, written by the trainer) gives loss,
validation perplexity, learning rate, gradient norm and throughput; the left column plots them
against the iteration, the right one against consumed tokens (consumed samples for a model that
declares no tokens per sample). A resumed run logs some iterations twice: the later value is kept.
Bad input ends with one `error: ...` line and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from libai_lite.utils.errors import UsageError
from libai_lite.utils.files import atomic_write
from libai_lite.utils.paths import check_outputs

# (title, [(metrics.json key, unit)]: the first key any run logged is the panel's, log scale)
PANELS = [
    ("loss", [("total_loss", "")], False),
    ("validation perplexity", [("valid/PPL", "")], True),
    ("learning rate", [("lr", "")], False),
    ("gradient norm", [("grad_norm", "")], False),
    # samples/s for models that declare no tokens per sample.
    ("throughput", [("tokens_per_sec", "tokens/s"), ("samples_per_sec", "samples/s")], False),
]
PANEL_INCHES, DPI = (6.0, 3.0), 100


def read_metrics(output_dir: str) -> dict[int, dict]:
    """iteration -> its scalars, rows of one iteration merged in file order (a resumed run's later rows win)."""
    path = os.path.join(output_dir, "metrics.json")
    if not os.path.isfile(path):
        raise UsageError(f"{path} not found; pass a training run's train.output_dir")
    # Undecodable bytes become rows that are not JSON, reported as such.
    with open(path, errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows: dict[int, dict] = {}
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
            it = int(row.pop("iteration"))
        except (ValueError, KeyError, TypeError, AttributeError):
            if i == len(lines) - 1 and rows:  # a run killed mid-write leaves a truncated last line
                break
            raise UsageError(f"{path} line {n} is not a metrics row (JSON with an iteration)") from None
        rows.setdefault(it, {}).update(row)
    if not rows:
        raise UsageError(f"{path} has no rows yet; plot once the run has logged (train.log_period)")
    return dict(sorted(rows.items()))


def tokens_per_sample(rows: dict[int, dict]) -> float | None:
    """The run's tokens per sample (its tokens/s over samples/s), None when it logs no tokens."""
    ratios = [r["tokens_per_sec"] / r["samples_per_sec"] for r in rows.values()
              if r.get("tokens_per_sec") and r.get("samples_per_sec")]
    return sorted(ratios)[len(ratios) // 2] if ratios else None


def consumed(rows: dict[int, dict], scale: float) -> dict[int, float] | None:
    """iteration -> consumed samples x `scale` for every row, interpolated for rows that have none."""
    import numpy as np

    logged = [(it, r["consumed_samples"]) for it, r in rows.items() if "consumed_samples" in r]
    if not logged:
        return None
    its, samples = (np.array(v, dtype=float) for v in zip(*logged))
    # Evaluation-only rows (an iteration not logged) sit on the line between their logged neighbours.
    return {it: float(np.interp(it, its, samples)) * scale for it in rows}


def series(rows: dict[int, dict], key: str):
    """(iterations, values) of `key` in the run, or None."""
    points = [(it, r[key]) for it, r in rows.items() if r.get(key) is not None]
    return ([p[0] for p in points], [p[1] for p in points]) if points else None


def plot(runs: dict[str, dict[int, dict]], output: str):
    """Draw `runs` (label -> rows) into `output`; returns the figure (one panel per metric and x-axis)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("tools/plot_metrics.py needs matplotlib: pip install -e .[plot] (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    # Tokens only when every run has them: runs overlaid on one axis must share its unit.
    per_sample = {label: tokens_per_sample(rows) for label, rows in runs.items()}
    use_tokens = all(v is not None for v in per_sample.values())
    x_right = "consumed tokens" if use_tokens else "consumed samples"
    x_of = {label: consumed(rows, per_sample[label] if use_tokens else 1.0) for label, rows in runs.items()}

    fig, axes = plt.subplots(len(PANELS), 2, figsize=(2 * PANEL_INCHES[0], len(PANELS) * PANEL_INCHES[1]),
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row_axes, (title, keys, log) in zip(axes, PANELS):
        key, unit = next(((k, u) for k, u in keys if any(series(rows, k) for rows in runs.values())), keys[0])
        for col, ax in enumerate(row_axes):
            drawn = False
            for i, (label, rows) in enumerate(runs.items()):
                found = series(rows, key)
                if found is None or (col == 1 and x_of[label] is None):
                    continue
                its, values = found
                xs = its if col == 0 else [x_of[label][it] for it in its]
                # Short curves (a few evaluations) need markers to be seen at all.
                ax.plot(xs, values, label=label, color=colors[i % len(colors)], marker="o" if len(xs) < 20 else None,
                        markersize=3, linewidth=1.2)
                drawn = True
            ax.set_title(f"{title} ({unit})" if unit else title)
            ax.set_xlabel("iteration" if col == 0 else x_right)
            ax.grid(True, alpha=0.3)
            if not drawn:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
                continue
            if log:
                ax.set_yscale("log")
            if len(runs) > 1:
                ax.legend(fontsize="small")
    fig.suptitle(", ".join(runs))
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        # Write-then-rename: a reader never sees half a PNG, and a failure leaves no temporary.
        atomic_write(output, lambda f: fig.savefig(f, dpi=DPI, format="png"), fsync=False)
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror or e}; make its folder writable or give -o another "
                         f"path") from e
    finally:
        plt.close(fig)
    return fig


def run_labels(dirs: list[str]) -> list[str]:
    """Each run's directory name, or its path where two runs share a name."""
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    return [n if names.count(n) == 1 else os.path.normpath(d) for n, d in zip(names, dirs)]


def main(argv=None) -> int:
    """Plot the runs given on the command line; a user error prints one `error:` line and returns 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dirs", nargs="+", metavar="OUTPUT_DIR", help="a training run's train.output_dir")
    parser.add_argument("-o", "--output", help="the PNG to write (default: FIRST_OUTPUT_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        labels = run_labels(args.output_dirs)
        if len(set(labels)) != len(labels):
            raise UsageError("an OUTPUT_DIR is given twice; pass each run once")
        output = args.output or os.path.join(args.output_dirs[0], "metrics.png")
        check_outputs([output], [os.path.join(d, "metrics.json") for d in args.output_dirs], option="-o")
        runs = {label: read_metrics(d) for label, d in zip(labels, args.output_dirs)}
        plot(runs, output)
    except UsageError as e:
        if os.environ.get("LIBAI_LITE_TRACEBACK"):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
