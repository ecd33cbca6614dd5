"""The teaching plots' one figure: facts recalled, held-out rewordings and
controls kept, as fractions, against steps, jobs or facts held; used by
teach_eval.py and plot_jobs.py (matplotlib, imported when drawing)."""

from __future__ import annotations


def rates(s: dict) -> dict[str, float]:
    """A report summary's fractions by label: facts recalled, held-out
    rewordings, and each kind of control it has (generic, near, user)
    kept identical."""
    out = {
        "facts recalled": s["recalled"] / s["facts"],
        "held-out rewordings": s["rewordings_recalled"] / max(1, s["rewordings"]),
    }
    for kind in ("generic", "near", "user"):
        if s.get(f"{kind}_controls"):
            out[f"{kind} controls identical"] = s[f"{kind}_controls_identical"] / s[f"{kind}_controls"]
    return out


def figure(xs, summaries, xlabel, title, path, loc, ticks=True, also=None) -> None:
    """One line per rate against xs, written to `path` (PNG); `also`: a
    summary at one more x, drawn as hollow squares in each line's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label in rates(summaries[0]):
        line = ax.plot(xs, [rates(s)[label] for s in summaries], marker="o", label=label)
        if also is not None:
            ax.plot([also[0]], [rates(also[1])[label]], marker="s", markerfacecolor="none",
                    color=line[0].get_color(), linestyle="none")  # fmt: skip
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction")
    ax.set_ylim(-0.03, 1.03)
    if ticks:
        ax.set_xticks(xs)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8, loc=loc)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
