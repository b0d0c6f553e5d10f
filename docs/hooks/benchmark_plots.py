"""MkDocs hook: the benchmark tables and plots, drawn from the benchmarks' JSON output.

`docs/benchmarks/<name>.json` is what `python benchmarks/<name>.py --json PATH` writes
(`comm`, `hub`, `dry_plan`, `checkpoint`, `targets`). At build time this hook

- replaces each `<!-- bench:NAME -->` line of a page with a Markdown table drawn from
  that JSON (`TABLES`), and
- adds one SVG per entry of `PLOTS` to the site, at `benchmarks/<plot>.svg`, drawn with
  matplotlib (its SVG canvas, never `pyplot`), so pages embed them as
  `![...](benchmarks/<plot>.svg)`.

To refresh the figures, run a benchmark with `--json docs/benchmarks/<name>.json`; the
tables and plots follow on the next `mkdocs build`. Nothing here runs a model.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "benchmarks"
GiB = 2**30
MiB = 2**20
KiB = 2**10
LAYOUT_COLOURS = {
    "formula": "#9e9e9e",
    "auto": "#1f77b4",
    "preset": "#2ca02c",
    "keras docs map": "#d62728",
    "auto + k/v output rule": "#17becf",
    "data-parallel": "#ff7f0e",
}
_PLACEHOLDER = re.compile(r"^<!-- bench:(\w+) -->$", re.MULTILINE)


def load(name: str) -> Any:
    """The JSON a benchmark wrote, from `docs/benchmarks/<name>.json`."""
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    align = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _kib(value: float) -> str:
    return f"{value / KiB:,.1f}"


def comm_table(data: dict) -> str:
    """The communication benchmark: bytes sent and state per device, per model, mesh and layout."""
    rows = []
    for r in data["rows"]:
        sizes = "×".join(part.split("=")[1] for part in r["mesh"].split(","))
        mesh = "data=8" if r["layout"] == "data-parallel" else sizes  # "2×4": data × model
        if r["error"]:
            cells = [f"crashes ({r['error']})", "", "", "", "", "", ""]
        elif r["layout"] == "formula":
            cells = [_kib(r["wire_bytes"]), "", "", "1.00", "0", _kib(r["state_bytes"]), "1.00"]
        else:
            cells = [
                _kib(r["wire_bytes"]),
                _kib(r["by_axis"].get("model", 0.0)),
                _kib(r["by_axis"].get("data", 0.0)),
                f"{r['vs_formula']:.2f}",
                str(r["all_gathers"]),
                _kib(r["state_bytes"]),
                f"{r['vs_ideal_state']:.2f}",
            ]
        rows.append([r["model"], mesh, r["layout"], *cells])
    header = ["model", "mesh (data×model)", "layout", "sent (KiB)", "over model", "over data", "/ formula",
              "all-gathers", "state (KiB)", "/ ideal"]  # fmt: skip
    return _table(header, rows, right=set(range(3, 10)))


def hub_table(data: list) -> str:
    """The keras-hub benchmark: wire, state and compiled peak per device, and the planner's prediction."""

    def predicted(value: float | None, compiled: float) -> str:
        return "" if value is None else f"{value / MiB:.2f} MiB ({value / compiled:.3f})"

    rows = []
    for r in data:
        rows.append(
            [
                r["model"],
                r["mesh"],
                r["layout"],
                f"{r['wire_bytes'] / MiB:.2f} MiB",
                f"{r['state_bytes'] / MiB:.2f} MiB",
                f"{r['peak_bytes'] / MiB:.2f} MiB",
                predicted(r["predicted_wire_bytes"], r["wire_bytes"]),
                predicted(r["predicted_peak_bytes"], r["peak_bytes"]),
                r["note"],
            ]
        )
    header = ["model", "mesh", "layout", "wire / device / step", "state / device", "compiled peak / device",
              "planner's wire (÷ compiled)", "planner's peak (÷ compiled)", "note"]  # fmt: skip
    return _table(header, rows, right={3, 4, 5, 6, 7})


def dry_plan_table(data: list) -> str:
    """The dry-planning benchmark: time, peak memory and per-device state, dry and real."""
    rows = [
        [
            r["size"],
            r["mode"],
            f"{r['parameters'] / 1e9:.2f} B",
            f"{r['seconds']:.1f} s",
            f"{r['peak_rss_bytes'] / MiB:,.0f} MiB",
            f"{r['peak_rss_over_fp32_model']:.3f}",
            f"{r['state_per_device_bytes'] / 2**30:.2f} GiB",
        ]
        for r in data
    ]
    header = ["model", "mode", "parameters", "planning time (after imports)", "peak RSS",
              "RSS / fp32 model size", "training state per device"]  # fmt: skip
    return _table(header, rows, right={2, 3, 4, 5, 6})


def checkpoint_table(data: dict) -> str:
    """The checkpoint benchmark: peak and extra host memory while loading, over the model's size."""
    model = data["model_bytes"]

    def rate(seconds: float | None) -> str:
        return "" if not seconds else f"{model / seconds / 1e6:.0f}"

    rows = [
        [
            f"`{r['how']}`",
            f"{r['peak_over_model']:.2f}",
            f"{r['peak_over_model_cold']:.2f}" if "peak_over_model_cold" in r else "",
            f"{r['extra_over_model']:.2f}",
            rate(r["seconds"]) if r.get("file_bytes") else "",
            rate(r.get("save_seconds")),
        ]
        for r in data["results"]
    ]
    return _table(
        ["format", "peak / held", "counting XLA's start-up", "extra / held", "load MB/s", "save MB/s"],
        rows,
        right={1, 2, 3, 4, 5},
    )


def _chosen_mesh(r: dict) -> str:
    """The mesh `choose_mesh` picked, marked `fsdp` where its plan is the fully sharded one (best first)."""
    fsdp = r.get("fsdp", r["alternatives"][0].get("fsdp"))  # rows before "fsdp" was recorded
    return r["mesh"] + (" fsdp" if fsdp else "")


def targets_table(data: list) -> str:
    """The TPU targets benchmark: the mesh chosen, predicted against XLA:TPU's peak and bytes, times."""
    rows = []
    for r in data:
        model = f"{r['model']} ({r['layers']} of {r['full_depth']} layers)"
        predicted = f"{r['predicted_peak_bytes'] / GiB:.2f}"
        if r["compile_error"]:
            needs = re.search(r"temporaries \(([\d.]+G)\)", r["compile_error"])
            refused = f"refused: temporaries {needs.group(1)}iB over the HBM" if needs else r["compile_error"]
            cells = [predicted, refused, "", "no", "", "", "—"]
        else:
            sent = sum(r["compiled_wire_bytes_by_axis"].values())
            cells = [
                predicted,
                f"{r['compiled_peak_bytes'] / GiB:.2f}",
                f"{r['peak_ratio']:.2f}",
                "yes" if r["fits"] else "no",
                f"{sent / GiB:.2f}",
                f"{r['wire_ratio']:.3f}",
                f"{r['compile_seconds']:.0f}",
            ]
        rows.append([model, r["target"], _chosen_mesh(r), *cells[:6], f"{r['plan_seconds']:.0f}", cells[6]])
    header = ["model (depth compiled)", "target", "mesh chosen", "peak predicted (GiB)",
              "peak compiled (GiB)", "ratio", "fits HBM", "sent/step compiled (GiB)",
              "bytes predicted ÷ compiled", "plan (s)", "compile (s)"]  # fmt: skip
    return _table(header, rows, right=set(range(3, 11)))


TABLES: dict[str, tuple[str, Callable[[Any], str]]] = {
    "comm": ("comm", comm_table),
    "hub": ("hub", hub_table),
    "dry_plan": ("dry_plan", dry_plan_table),
    "checkpoint": ("checkpoint", checkpoint_table),
    "targets": ("targets", targets_table),
}


def _figure(width: float, height: float):
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasSVG(figure)
    return figure


def _svg(figure) -> bytes:
    import matplotlib

    out = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "keras_meshlayout", "svg.fonttype": "none"}):
        figure.savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()


def comm_plot(data: dict) -> bytes:
    """Bytes sent per device per step, by layout, for each model and mesh (one panel a model)."""
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    figure = _figure(11, 3.6)
    axes = figure.subplots(1, len(models))
    for ax, model in zip(axes, models, strict=True):
        rows = [r for r in data["rows"] if r["model"] == model and not r["error"]]
        meshes = list(dict.fromkeys(r["mesh"] for r in rows))
        layouts = [name for name in LAYOUT_COLOURS if any(r["layout"] == name for r in rows)]
        width = 0.8 / len(layouts)
        for j, layout in enumerate(layouts):
            values = [
                next((r["wire_bytes"] / KiB for r in rows if r["mesh"] == m and r["layout"] == layout), 0.0)
                for m in meshes
            ]
            ax.bar([i + j * width for i in range(len(meshes))], values, width, label=layout,
                   color=LAYOUT_COLOURS[layout])  # fmt: skip
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(meshes))])
        ax.set_xticklabels([m.replace("data=", "").replace(",model=", "×") for m in meshes])
        ax.set_title(model)
        ax.set_xlabel("mesh (data × model)")
    axes[0].set_ylabel("KiB sent per device per step")
    handles, labels = axes[-1].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False)
    figure.suptitle("Communication per training step (compiled HLO; data-parallel is data=8 on every mesh)")
    return _svg(figure)


def hub_plot(data: list) -> bytes:
    """Wire bytes against per-device state for every layout, one panel per model and mesh."""
    cases = list(dict.fromkeys((r["model"], r["mesh"]) for r in data))
    figure = _figure(11, 7)
    axes = figure.subplots(2, (len(cases) + 1) // 2, squeeze=False).ravel()
    markers = {"keras-hub map": ("s", "#d62728"), "data-parallel (8×1)": ("^", "#ff7f0e"),
               "preset": ("D", "#2ca02c")}  # fmt: skip
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, (model, mesh) in zip(axes, cases, strict=False):
        points: dict[tuple[float, float], list[str]] = {}
        for r in data:
            if (r["model"], r["mesh"]) != (model, mesh) or r["wire_bytes"] is None:
                continue
            marker, colour = markers.get(r["layout"], ("o", "#1f77b4"))
            x, y = r["state_bytes"] / MiB, r["wire_bytes"] / MiB
            ax.scatter([x], [y], marker=marker, color=colour, s=40, zorder=3)
            points.setdefault((round(x, 1), round(y, 1)), []).append(r["layout"])
        for (x, y), names in points.items():  # layouts that coincide share one label
            ax.annotate(" = ".join(names), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.set_title(f"{model}, {mesh}")
        ax.set_xscale("log")
        ax.set_xticks([2, 3, 5, 10, 20, 30])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.margins(x=0.3, y=0.12)
        ax.set_xlabel("state per device (MiB, log scale)")
        ax.set_ylabel("sent per device per step (MiB)")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(cases) :]:
        ax.set_visible(False)
    figure.suptitle("keras-hub decoders: memory against traffic for each layout (lower left is better)")
    return _svg(figure)


def dry_plan_plot(data: list) -> bytes:
    """Planning time and peak resident memory, dry against a real build."""
    labels = [f"{r['size']} {r['mode']}\n{r['parameters'] / 1e9:.2f} B params" for r in data]
    figure = _figure(9, 3.2)
    left, right = figure.subplots(1, 2)
    left.barh(labels, [r["seconds"] for r in data], color="#1f77b4")
    left.set_xlabel("planning time (s, after imports)")
    right.barh(labels, [r["peak_rss_bytes"] / MiB for r in data], color="#ff7f0e")
    right.set_xlabel("peak resident memory (MiB)")
    right.set_yticklabels([])
    for ax in (left, right):
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    figure.suptitle("Planning a decoder without allocating it (dry) and after building it (real)")
    return _svg(figure)


def checkpoint_plot(data: dict) -> bytes:
    """Peak host memory while loading, over the model's size, for each format."""
    results = data["results"]
    labels = [r["how"] for r in results]
    figure = _figure(9, 3.8)
    ax = figure.subplots()
    ax.barh(labels, [r["peak_over_model"] for r in results], color="#1f77b4", label="peak / model")
    ax.barh(labels, [r["extra_over_model"] for r in results], color="#ff7f0e", height=0.4,
            label="extra beyond the model / model")  # fmt: skip
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.invert_yaxis()
    ax.set_xlabel(f"host memory over the model's size ({data['model_bytes'] / MiB:.0f} MiB model)")
    figure.legend(loc="outside lower center", ncols=2, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    figure.suptitle("Loading a checkpoint saved on 2×4 onto 1×8 (emulated devices: 1.0 is the model itself)")
    return _svg(figure)


def targets_plot(data: list) -> bytes:
    """Predicted against XLA:TPU's compiled per-device peak, and the compile times, per model and target."""
    labels = [f"{r['model']}\n{r['target']} ({_chosen_mesh(r)})" for r in data]
    figure = _figure(10, 4.2)
    left, right = figure.subplots(1, 2)
    rows = range(len(data))
    left.barh([i - 0.2 for i in rows], [r["predicted_peak_bytes"] / GiB for r in data], height=0.4,
              color="#1f77b4", label="predicted")  # fmt: skip
    compiled = [0.0 if r["compile_error"] else r["compiled_peak_bytes"] / GiB for r in data]
    left.barh([i + 0.2 for i in rows], compiled, height=0.4, color="#ff7f0e", label="XLA:TPU compiled")
    for i, r in enumerate(data):
        left.plot([r["hbm_bytes"] / GiB] * 2, [i - 0.45, i + 0.45], color="black", linewidth=1.2)
        if r["compile_error"]:
            left.annotate(" refused: over HBM", (0, i + 0.2), va="center", fontsize=7)
    left.set_yticks(list(rows), labels, fontsize=7)
    left.set_xlabel("peak per chip (GiB; black: the chip's HBM)")
    left.legend(fontsize=7, loc="lower right")
    plan = [r["plan_seconds"] for r in data]
    right.barh([i - 0.2 for i in rows], plan, height=0.4, color="#2ca02c", label="plan (choose_mesh)")
    compile_ = [r["compile_seconds"] or 0.0 for r in data]
    right.barh([i + 0.2 for i in rows], compile_, height=0.4, color="#9467bd", label="compile (XLA:TPU)")
    right.set_yticks(list(rows), [""] * len(data))
    right.set_xlabel("seconds (2 loaded CPU cores)")
    right.legend(fontsize=7, loc="lower right")
    for ax in (left, right):
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    depth = f"{data[0]['layers']} layers at full width" if data else ""
    figure.suptitle(f"Meshes chosen for rented TPUs ({depth}): peak per chip, time to plan and compile")
    return _svg(figure)


PLOTS: dict[str, tuple[str, Callable[[Any], bytes]]] = {
    "comm_sent": ("comm", comm_plot),
    "hub_tradeoff": ("hub", hub_plot),
    "dry_plan": ("dry_plan", dry_plan_plot),
    "checkpoint_memory": ("checkpoint", checkpoint_plot),
    "targets": ("targets", targets_plot),
}


def render_tables(markdown: str) -> str:
    """Replaces every `<!-- bench:NAME -->` line with the table `TABLES[NAME]` draws."""

    def table(match: re.Match) -> str:
        source, draw = TABLES[match.group(1)]
        return draw(load(source))

    return _PLACEHOLDER.sub(table, markdown)


def render_plots() -> dict[str, bytes]:
    """Every plot of `PLOTS`, as SVG bytes keyed by `benchmarks/<name>.svg`."""
    return {f"benchmarks/{name}.svg": draw(load(source)) for name, (source, draw) in PLOTS.items()}


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for uri, content in render_plots().items():
        files.append(File.generated(config, uri, content=content))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    return render_tables(markdown)
