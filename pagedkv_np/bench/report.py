"""Output of ``pagedkv bench``: the fixed-width table and the gather plot.

The JSON output is the records themselves (see :data:`.cases.FIELDS`).
matplotlib is imported only when a plot is asked for; without it the
ImportError says which extra to install.
"""

from __future__ import annotations

from ..errors import ConfigError
from .cases import GATHER_TOKENS, HEAD_DIM, NUM_KV_HEADS

__all__ = ["format_header", "format_row", "format_table", "import_pyplot", "plot_gather"]

_COLUMNS = (("op", 14), ("backend", 8), ("dtype", 9), ("layout", 10), ("case", 26),
            ("time", 10), ("throughput", 16), ("copy GB/s", 10), ("x copy", 7),
            ("median", 6))


def _fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _fmt_rate(value: float, unit: str) -> str:
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix} {unit}"
    return f"{value:.3g} {unit}"


def format_row(rec: dict) -> str:
    """One record as a row of the table."""
    layout = rec["layout"] or "-"
    if rec["out_layout"]:
        layout += ">" + rec["out_layout"]
    if rec["gbps"] is not None:
        throughput = f"{rec['gbps']:.3g} GB/s"
        copy, ratio = f"{rec['copy_gbps']:.3g}", f"{rec['ratio']:.2f}"
        median = f"{rec['ratio_median']:.2f}"
    else:
        throughput, copy, ratio = _fmt_rate(rec["rate"], rec["rate_unit"]), "", ""
        median = ""
    cells = (rec["op"], rec["backend"] or "-", rec["dtype"] or "-", layout, rec["case"],
             _fmt_time(rec["seconds"]), throughput, copy, ratio, median)
    return "  ".join(str(c).ljust(w) for c, (_, w) in zip(cells, _COLUMNS)).rstrip()


def format_header() -> str:
    """The table's header line."""
    return "  ".join(name.ljust(w) for name, w in _COLUMNS).rstrip()


def format_table(records: list[dict]) -> str:
    """The records as a fixed-width text table."""
    return "\n".join([format_header()] + [format_row(r) for r in records])


def import_pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or an ImportError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib; install it with: pip install 'pagedkv-np[plot]'"
        ) from exc
    return plt


def plot_gather(records: list[dict], path: str) -> None:
    """Plot gather bandwidth (BHTD) against batch size, one line per backend
    and one panel per dtype, with the copy ceiling as a dashed line.

    Parameters
    ----------
    records : list of dict
        From :func:`run_benchmarks`; the ``gather`` records are plotted.
    path : str
        Where to write the image; the format follows the extension.

    Raises
    ------
    ImportError
        matplotlib is not installed (the message says what to install).
    """
    plt = import_pyplot()
    rows = [r for r in records if r["op"] == "gather" and r["out_layout"] == "BHTD"
            and r["layout"] == "NHD"]
    if not rows:
        raise ConfigError("Invalid records: no gather results to plot")
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))  # in run order
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        mine = sorted((r for r in rows if r["dtype"] == dtype),
                      key=lambda r: r["params"]["num_seqs"])
        for name in sorted({r["backend"] for r in mine}):
            pts = [r for r in mine if r["backend"] == name]
            ax.plot([r["params"]["num_seqs"] for r in pts], [r["gbps"] for r in pts],
                    marker="o", label=name)
        ceiling = {r["params"]["num_seqs"]: r["copy_gbps"] for r in mine}
        xs = sorted(ceiling)
        ax.plot(xs, [ceiling[x] for x in xs], "k--", label="plain copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(f"batch size (sequences of {GATHER_TOKENS} tokens)")
        ax.set_ylabel("GB/s (read + written)")
        ax.set_title(f"gather, {dtype}, {NUM_KV_HEADS}x{HEAD_DIM}, NHD -> BHTD")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
