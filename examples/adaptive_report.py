"""The report of examples/adaptive_batch.py: the markdown table, the verdict on the targets, what the policy
did, and the plot. Not an example by itself: adaptive_batch.py imports it (it sits beside it in examples/).

A run's record is a dict: "name", "adaptive" (whether the policy drives the run), "evals" (one tuple per
evaluation: training seconds, steps, samples, test accuracy, noise scale or 0, global batch, LR), "changes"
(one tuple per change: seconds, step, batch, LR, the policy's words) and "last" (the policy's last decision).
"""

import numpy as np


def first_reach(rec, target):
    """(training seconds, steps) of the first evaluation at or above target, or None."""
    return next(((e[0], e[1]) for e in rec["evals"] if e[3] >= target), None)


def report(records, targets, main, min_gain):
    """The results as markdown lines: the table, the targets (met or NOT met) and what the policy did."""
    cell = lambda hit: f"{hit[0]:.1f} s / {hit[1]} steps" if hit else "never"  # noqa: E731
    lines = ["| run | global batch | LR | " + " | ".join(f"to {t:g}" for t in targets)
             + " | final accuracy | ms per step |", "|---" * (5 + len(targets)) + "|"]
    for r in records:
        sizes = sorted({e[5] for e in r["evals"]})
        batch = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} -> {sizes[-1]}"
        lrs = sorted({round(e[6], 5) for e in r["evals"]})
        lr = f"{lrs[0]:g}" if len(lrs) == 1 else f"{lrs[0]:g} -> {lrs[-1]:g}"
        hits = " | ".join(cell(first_reach(r, t)) for t in targets)
        last = r["evals"][-1]
        lines.append(f"| {r['name']} | {batch} | {lr} | {hits} | {last[3]:.3f} | {1e3 * last[0] / last[1]:.0f} |")
    lines.append("")
    adaptive = [r for r in records if r["adaptive"]]
    fixed = [r for r in records if not r["adaptive"]]
    if adaptive and fixed:
        lines += verdict(adaptive[0], fixed, main)
    for r in adaptive:
        lines += ["", *story(r, min_gain)]
    return lines


def verdict(ad, fixed, main):
    """The times to main, adaptive against the fastest fixed run there, and the issue's two targets."""
    reached = [(first_reach(r, main), r) for r in fixed if first_reach(r, main)]
    best = min(reached, key=lambda hr: hr[0][0]) if reached else None
    mine = first_reach(ad, main)
    if best is None:
        ratio = "no fixed run reached it" + (f"; adaptive did, in {mine[0]:.1f} s" if mine else ", nor did adaptive")
        met = mine is not None
    elif mine is None:
        ratio, met = f"adaptive never reached it; {best[1]['name']} did in {best[0][0]:.1f} s", False
    else:
        x = mine[0] / best[0][0]
        ratio, met = f"{x:.2f}x ({mine[0]:.1f} s against {best[1]['name']}'s {best[0][0]:.1f} s)", x <= 0.75
    times = ", ".join(f"{r['name']} " + (f"{h[0]:.1f} s" if h else "never")
                      for r, h in ((r, first_reach(r, main)) for r in fixed + [ad]))
    small = min(fixed, key=lambda r: r["evals"][0][5])  # the smallest fixed batch
    fa, fs = ad["evals"][-1][3], small["evals"][-1][3]
    return [f"Training time to test accuracy {main:g}: {times}.",
            f"Adaptive / best fixed run, training time to {main:g}: {ratio}.",
            f"- Target: adaptive reaches {main:g} in <= 0.75x the time of the best fixed batch: "
            f"{'met' if met else 'NOT met'}.",
            f"- Target: final accuracy no worse than the smallest fixed batch's ({small['name']}): "
            f"{'met' if fa >= fs else 'NOT met'} ({fa:.3f} against {fs:.3f})."]


def story(rec, min_gain):
    """What the policy changed and when, and the noise scale it saw, in words."""
    ev = rec["evals"]
    gns = [(e[0], e[4]) for e in ev if e[4] > 0]
    seen = ", ".join(f"{g:.0f} at {t:.1f} s" for t, g in gns[::max(1, len(gns) // 5)])
    made = f"made {len(rec['changes'])} change(s):" if rec["changes"] else "changed nothing."
    lines = [f"What the policy did in the adaptive run: it started at global batch {ev[0][5]} "
             f"(LR {ev[0][6]:g}; it moves for a predicted gain of at least {min_gain:.0%}, "
             f"--min_gain) and {made}"]
    for t, _, _, _, said in rec["changes"]:
        lines.append(f"- {t:.1f} s, {said}")
    lines.append(f"Its last decision: {rec['last']}.")
    lines.append(f"The noise scale (gns, in samples) it read: {seen}; at the end {ev[-1][4]:.0f}, "
                 f"with the batch at {ev[-1][5]} and the LR at {ev[-1][6]:g}.")
    return lines


def plot(records, main, bayes, path, workers):
    """Four panels over training time: the global batch, the noise scale, the LR and the test accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    for r in records:
        ev = np.array(r["evals"], dtype=np.float64)
        # batch and LR: from the changes themselves (when they happened), held to the end
        controls = np.array([(0.0, ev[0, 5], ev[0, 6])] + [c[0:1] + c[2:4] for c in r["changes"]]
                            + [(ev[-1, 0], ev[-1, 5], ev[-1, 6])])
        axes[0].plot(controls[:, 0], controls[:, 1], drawstyle="steps-post", label=r["name"])
        known = ev[:, 4] > 0  # 0: no estimate yet
        axes[1].plot(ev[known, 0], ev[known, 4])
        axes[2].plot(controls[:, 0], controls[:, 2], drawstyle="steps-post")
        axes[3].plot(ev[:, 0], ev[:, 3], marker=".", ms=3)
    for ax, label in zip(axes, ["global batch size", "gradient noise scale (samples)", "learning rate",
                                "test accuracy"]):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log", base=2)
    axes[1].set_yscale("log")
    axes[0].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axes[1].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    axes[3].axhline(main, color="gray", lw=0.8, ls="--", label=f"target {main:g}")
    axes[3].axhline(bayes, color="gray", lw=0.8, ls=":", label=f"best possible {bayes:.3f}")
    axes[3].set_ylim(main - 0.1, max(main, bayes) + 0.02)
    axes[3].legend(loc="lower right")
    axes[3].set_xlabel("training time, s (evaluation not counted)")
    axes[0].legend()
    axes[0].set_title(f"KungFu: fixed and adaptive batch size, {workers} workers")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
