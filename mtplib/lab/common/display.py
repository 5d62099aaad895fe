"""How notebooks and plots show numbers: rounded tables with missing values shown as
missing, the public sources of the reference numbers, and one set of plot conventions.

Why one module: every plot of the project follows the same rules (a title naming what and
which model / plan, axis labels with units, legends outside the data, reference lines in
colours no data line uses), and tests/test_plots.py checks them on every plot function;
every table a notebook shows goes through `show`, so no cell prints 1468.669053 or turns a
value that was not measured into 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# -- the reference numbers' public sources --------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """A published number the benchmark compares against: where a reader finds it."""

    label: str  # short name used in plot legends
    title: str  # the document's title
    url: str  # where it is
    where: str  # the place in the document and what it says

    def cite(self) -> str:
        return f"{self.title}, {self.where}: {self.url}"


#: The public sources of the comparison numbers (REFERENCE_S9 below). Legends say
#: "ref." and a short label; `references_table()` gives the full citation.
REFERENCES: dict[str, Reference] = {
    "deepseek_v3": Reference(
        label="DeepSeek-V3 report",
        title="DeepSeek-V3 Technical Report (arXiv:2412.19437)",
        url="https://arxiv.org/abs/2412.19437",
        where="§5.4.3 (MTP evaluation): second-token acceptance 85-90%, 1.8x TPS"),
    "llama_cpp_pr": Reference(
        label="llama.cpp PR #25784",
        title="ggml-org/llama.cpp pull request #25784, 'DeepseekV4 MTP + DSpark'",
        url="https://github.com/ggml-org/llama.cpp/pull/25784",
        where="description: about 1.5x with --spec-draft-n-max 2, 16.4 tok/s before "
              "(DGX Spark)"),
    "vllm_v4": Reference(
        label="vLLM V4 MTP",
        title="vLLM, DeepSeek-V4 MTP serving recipe (vllm-project/recipes)",
        url="https://github.com/vllm-project/recipes",
        where="per-position acceptance 77% / 37% with num_speculative_tokens=2, as recorded "
              "in this project's reference notes; the page with that exact figure was not "
              "re-located, the link is vLLM's V4 recipe collection"),
}

#: The published reference numbers (the comparison column; not measured here). Their public
#: sources (title, url) are `REFERENCES`, under the same keys.
REFERENCE_S9 = {
    "deepseek_v3": {"source": "DeepSeek-V3 report", "k": 1,
                    "second_token_acceptance_low": 0.85, "second_token_acceptance_high": 0.90,
                    "speedup": 1.8},
    "llama_cpp_pr": {"source": "llama.cpp V4 MTP PR", "k": 2, "speedup": 1.5,
                     "baseline_tok_s": 16.4},
    "vllm_v4": {"source": "vLLM V4 MTP", "k": 2, "acceptance_per_position": [0.77, 0.37]},
}

# -- plot conventions -------------------------------------------------------------------------
#: colours of measured data (tab10 without red, grey and olive, which references use)
DATA_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
#: colours of reference lines and bands: never a data colour
REFERENCE_COLOURS = {"deepseek_v3": "#d62728", "vllm_v4": "#7f7f7f",
                     "llama_cpp_pr": "#bcbd22"}
#: neutral marks that are neither data nor a reference (the y = 1 line, whiskers)
NEUTRAL = "black"


def data_colour(i: int) -> str:
    """The i-th data colour; refuses to repeat one (a repeated colour would merge lines)."""
    if not 0 <= i < len(DATA_COLOURS):
        raise ValueError(f"more data series ({i + 1}) than distinct colours "
                         f"({len(DATA_COLOURS)}): split the plot into panels")
    return DATA_COLOURS[i]


def ref_label(key: str, what: str = "") -> str:
    """A legend label for a reference line: its short source name and what it shows."""
    r = REFERENCES[key]
    return f"{r.label}{': ' + what if what else ''} (ref.)"


def k_label(k: int) -> str:
    return "MTP off" if k == 0 else f"MTP k={k}"


def model_name(path: str) -> str:
    """A model file's name as a reader knows it: 'v4-v4-ratio-cpu-s0.gguf' -> 'fixture
    preset v4-ratio-cpu, seed 0' (the fixture writer prefixes 'v4-' to the preset)."""
    import re
    from pathlib import Path

    stem = Path(path).stem
    m = re.fullmatch(r"(?:mtp-)?v4-(.+)-s(\d+)", stem)
    if m:
        return f"fixture preset {m.group(1)}, seed {m.group(2)}"
    return stem


def new_figure(n_panels: int = 1, *, w: float = 5.0, h: float = 3.4, sharey: bool = True):
    """A pyplot-free Figure with ``n_panels`` side by side (constrained layout, so an
    outside legend and the title get their own room)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w * n_panels + 2.2, h), layout="constrained")
    axes = fig.subplots(1, n_panels, squeeze=False, sharey=sharey)[0]
    return fig, list(axes)


def legend_outside(fig, axes: Sequence | None = None, *, extra: Sequence = (), **kw):
    """One figure legend right of every panel, vertically centred (below the title), with
    the labels of ``axes`` deduplicated in first-seen order plus ``extra`` (handle, label)
    pairs: it never covers data or a title."""
    handles, labels = [], []
    pairs = [p for ax in (axes if axes is not None else fig.axes)
             for p in zip(*ax.get_legend_handles_labels(), strict=True)] + list(extra)
    for h, lab in pairs:
        if lab not in labels and not lab.startswith("_"):
            handles.append(h)
            labels.append(lab)
    if not handles:
        return None
    return fig.legend(handles, labels, loc="outside right center",
                      fontsize=kw.pop("fontsize", 8), **kw)


def ax_legend_outside(ax, **kw):
    """The legend of one Axes, right of it (for functions that draw into a given Axes)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                     fontsize=kw.pop("fontsize", 8), **kw)


def as_image(fig, dpi: int = 100):
    """A Figure as an IPython PNG Image: a notebook shows it the same way in any kernel,
    whether or not pyplot's inline backend is active (the plot functions use no pyplot)."""
    import io

    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return Image(data=buf.getvalue(), format="png")


# -- tables -----------------------------------------------------------------------------------
NA = "n/a"


def is_missing(v) -> bool:
    if v is None:
        return True
    try:
        import pandas as pd

        if v is pd.NA or v is pd.NaT:
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(v, float) and math.isnan(v)


def fmt_number(x: float, sig: int = 4) -> str:
    """``x`` to ``sig`` significant digits, never in exponent form for large values and
    never dropping integer digits: 1468.669053 -> '1469', 0.0222222 -> '0.02222',
    94973.94 -> '94974', 24.0 -> '24', 0.5 -> '0.5'."""
    if is_missing(x):
        return NA
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    a = abs(x)
    if a < 1e-3:
        return f"{x:.{max(sig - 1, 1)}g}" if a >= 1e-4 else f"{x:.{sig - 1}e}"
    dec = max(0, sig - 1 - math.floor(math.log10(a)))
    s = f"{round(x, dec):.{dec}f}"
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def fmt_value(v, sig: int = 4, *, nested: bool = False) -> str | int | bool:
    """One table cell: numbers rounded, missing as 'n/a', lists and dicts compact (a dict
    inside a list keeps its braces, so '[{len: 12, seed: 0}, {len: 12, seed: 1}]')."""
    import numpy as np

    if isinstance(v, bool | np.bool_):
        return bool(v)
    if isinstance(v, int | np.integer):
        return int(v)
    if isinstance(v, float | np.floating):
        return fmt_number(float(v), sig)
    if is_missing(v):
        return NA
    if isinstance(v, Mapping):
        body = ", ".join(f"{k}: {fmt_value(x, sig, nested=True)}" for k, x in v.items())
        return "{" + body + "}" if nested else body or "none"
    if isinstance(v, list | tuple | np.ndarray):
        return "[" + ", ".join(str(fmt_value(x, sig, nested=True)) for x in v) + "]"
    return v


def show(data, columns: Iterable[str] | None = None, *, sig: int = 4, index=None):
    """A table ready to display: rows (list of dicts) or a DataFrame, optional column
    selection (missing columns are skipped), every number rounded to ``sig`` significant
    digits, None / NaN shown as 'n/a' (never 0), lists and dicts written compactly."""
    import pandas as pd

    df = data.copy() if isinstance(data, pd.DataFrame) else pd.DataFrame(list(data))
    if columns is not None:
        df = df[[c for c in columns if c in df.columns]]
    if index is not None:
        df = df.set_index(index)
    out = df.astype(object).map(lambda v: fmt_value(v, sig))
    if not isinstance(df.index, pd.RangeIndex):  # a grouped or keyed table: its keys too
        out.index = df.index.map(lambda i: tuple(fmt_value(x, sig) for x in i)
                                 if isinstance(i, tuple) else fmt_value(i, sig))
        out.index.names = df.index.names
    return out


def references_table():
    """The reference numbers' sources: what each says, where, and a link."""
    import pandas as pd

    return pd.DataFrame([{"reference": k, "source": r.title, "where": r.where, "url": r.url}
                         for k, r in REFERENCES.items()])
