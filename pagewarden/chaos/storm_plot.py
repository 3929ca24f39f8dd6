"""The storm scenario's plot: batch size, profile and faults over time (one PNG).

matplotlib is an optional dependency (``pip install 'pagewarden[chaos]'``), imported only
when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from pagewarden.chaos.storm import StormReport


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def write_storm_plot(report: StormReport, path: str | Path) -> str:
    """Draw ``report`` into a PNG at ``path``; returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "the storm plot needs matplotlib: pip install 'pagewarden[chaos]' "
            "(or pass --plot '' to skip it)"
        ) from None
    s = report.samples
    t = [x.t for x in s]
    fig, (ax_batch, ax_profile, ax_faults) = plt.subplots(
        3, 1, sharex=True, figsize=(8, 5.2), gridspec_kw={"height_ratios": [3, 1, 1.4]}
    )
    for ax in (ax_batch, ax_profile, ax_faults):
        ax.axvspan(*report.burst, color="tab:red", alpha=0.08, lw=0)
    ax_batch.step(t, [x.max_num_seqs for x in s], where="post", label="batch limit (max_num_seqs)")
    ax_batch.plot(t, [x.running for x in s], lw=0.8, alpha=0.7, label="requests running")
    ax_batch.set_ylabel("sequences")
    ax_batch.set_ylim(0, report.config.max_num_seqs * 1.15)
    ax_batch.legend(loc="lower right", fontsize=8)
    ax_batch.set_title(
        f"pagewarden chaos --scenario storm ({report.model}): {report.injected} faults in "
        f"{report.burst[1] - report.burst[0]:.1f} s (shaded)",
        fontsize=10,
    )
    names = list(dict.fromkeys([report.config.profile, "safe", *(x.profile for x in s)]))
    ax_profile.step(t, [names.index(x.profile) for x in s], where="post", color="tab:purple")
    ax_profile.set_yticks(range(len(names)), names)
    ax_profile.set_ylim(-0.4, len(names) - 0.6)
    ax_profile.set_ylabel("profile")
    injected = [b.t for a, b in zip(s, s[1:]) if b.injected > a.injected]
    detected = [(x.t, x.detected) for x in s if x.detected]
    ax_faults.vlines(injected, 0, 1, color="tab:red", lw=1.2, label="injected")
    ax_faults.scatter(
        [d[0] for d in detected],
        [1.4] * len(detected),
        s=[18 * d[1] for d in detected],
        marker="x",
        color="black",
        label="detected and recovered",
    )
    ax_faults.set_ylim(-0.2, 1.9)
    ax_faults.set_yticks([])
    ax_faults.set_ylabel("faults")
    ax_faults.set_xlabel("seconds")
    ax_faults.legend(loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)
