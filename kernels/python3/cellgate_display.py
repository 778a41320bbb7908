"""How Plotly and Altair figures display in a cellgate kernel: an IPython extension.

Each figure is shown as one MIME bundle holding its interactive spec (for the web client,
which renders it with the Plotly and Vega libraries it embeds) and a PNG of it (for API v1
and MCP clients, which run no JavaScript, and for the language model reading the result),
plus a one-line text description.

Why not the libraries' defaults: Plotly's default in a kernel is `plotly_mimetype+notebook`
(an HTML page carrying 4 MB of plotly.js on a figure's first show) and Altair 6's is an HTML
page that loads Vega from a CDN, which neither the sandbox nor the web client may reach.
Neither gives a static image without a browser (Kaleido 1.x drives an installed Chrome;
none is in the kernel's environment or images). So:

- Altair: Vega-Lite to PNG with vl-convert (Vega and a JavaScript engine compiled into the
  wheel, no browser). The first render in a kernel takes ~1 s (the engine starts), later
  ones ~0.1 s. External data URLs are not fetched for the image (the egress policy governs
  the kernel's own requests; a chart whose data is a URL gets no PNG and says so).
- Plotly: the figure is drawn again with matplotlib (already in the environment, no
  browser): scatter and line, bar, histogram, pie, box and violin, heatmap, with subplots,
  titles, axis titles, log axes and legends. It is a preview, not Plotly's rendering; a
  trace of another type is left out of it and the image says so; a figure with none drawn
  gets no PNG. ~0.1-0.3 s per figure.

Loaded by kernel.json (`--IPKernelApp.extensions=cellgate_display`). Importing this module
imports neither library: a hook configures each one when user code first imports it, so
kernels that never chart pay nothing. A user's own choice (`pio.renderers.default = ...`,
`alt.renderers.enable(...)`, or `PLOTLY_RENDERER` in the environment) still wins.

`./dev setup` copies this file into each kernel venv's site-packages, beside the launcher.
"""

import base64
import importlib.abc
import io
import os
import sys

PLOTLY_MIME = "application/vnd.plotly.v1+json"
RENDERER = "cellgate"
# Plotly's default colorway, for figures whose template names none.
PLOTLY_COLORS = ["#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A",
                 "#19d3f3", "#FF6692", "#B6E880", "#FF97FF", "#FECB52"]


def load_ipython_extension(ipython) -> None:  # noqa: ARG001 - IPython's signature
    _when_imported("plotly.io._renderers", _configure_plotly)
    _when_imported("altair", _configure_altair)


# --- import hooks ---------------------------------------------------------------------------

_HOOKS = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Runs a hook right after a watched module has executed (Python has no post-import
    hook): finds the module's spec with the other finders and wraps its loader's
    exec_module, on that loader instance only."""

    def find_spec(self, name, path, target=None):
        hook = _HOOKS.pop(name, None)
        if hook is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _run_hook(hook, module)

        spec.loader.exec_module = exec_module
        return spec


def _when_imported(name, hook) -> None:
    module = sys.modules.get(name)
    if module is not None:  # imported already (a zygote's preload)
        _run_hook(hook, module)
        return
    _HOOKS[name] = hook
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _run_hook(hook, module) -> None:
    # A library version this module does not know must not break the user's import.
    try:
        hook(module)
    except Exception as err:  # noqa: BLE001
        print(f"cellgate: could not set up {module.__name__}'s display: {err!r}", file=sys.stderr)


# --- Plotly ---------------------------------------------------------------------------------


def _configure_plotly(renderers_module) -> None:
    from plotly.io._base_renderers import MimetypeRenderer

    registry = renderers_module.renderers
    interactive = registry["plotly_mimetype"]

    class CellgateRenderer(MimetypeRenderer):
        """The figure's JSON, a matplotlib preview PNG and a text line."""

        def to_mimebundle(self, fig_dict):
            bundle = interactive.to_mimebundle(fig_dict)
            figure = bundle[PLOTLY_MIME]
            note = ""
            try:
                png, skipped = plotly_png(figure)
            except Exception as err:  # noqa: BLE001 - the interactive figure still shows
                png, skipped = None, [f"preview failed: {err!r}"]
            if png is not None:
                bundle["image/png"] = base64.b64encode(png).decode()
            else:
                note = " (no static image)"
            if skipped:
                note += f" [{'; '.join(skipped)}]"
            bundle["text/plain"] = _plotly_text(figure) + note
            return bundle

    registry[RENDERER] = CellgateRenderer()
    if not os.environ.get("PLOTLY_RENDERER"):
        registry.default = RENDERER


def _title(value):
    if isinstance(value, dict):
        value = value.get("text")
    return value if isinstance(value, str) and value else None


def _plotly_text(figure) -> str:
    layout = figure.get("layout") or {}
    kinds = sorted({t.get("type", "scatter") for t in figure.get("data") or []})
    title = _title(layout.get("title"))
    return (f"Plotly figure{': ' + repr(title) if title else ''}, "
            f"{len(figure.get('data') or [])} trace(s): {', '.join(kinds) or 'none'}")


def _array(value):
    """A trace's data array as numpy: Plotly's JSON gives lists or typed arrays
    ({"dtype", "bdata", "shape"}); ISO date strings become datetimes."""
    import numpy as np

    if value is None:
        return None
    if isinstance(value, dict) and "bdata" in value:
        arr = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        if shape:
            if isinstance(shape, str):
                shape = [int(s) for s in shape.split(",")]
            arr = arr.reshape(shape)
        return arr
    arr = np.asarray(value, dtype=object)
    if arr.ndim == 1 and len(arr) and all(isinstance(v, str) for v in arr):
        try:
            return arr.astype("datetime64[ns]")
        except ValueError:
            return arr.astype(str)
    try:
        return arr.astype(float)
    except (TypeError, ValueError):
        return arr


def _numeric(arr) -> bool:
    return arr is not None and arr.dtype.kind in "fiumM"


def _dates(ax, x) -> None:
    """Short date labels that do not overlap, as Plotly's."""
    if getattr(x, "dtype", None) is not None and x.dtype.kind == "M":
        from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

        locator = AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator))


def plotly_png(figure):
    """A PNG preview of a Plotly figure (its JSON form) drawn with matplotlib, and the
    trace types left out; (None, skipped) when no trace could be drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layout = figure.get("layout") or {}
    template = (layout.get("template") or {}).get("layout") or {}
    colors = layout.get("colorway") or template.get("colorway") or PLOTLY_COLORS
    width = layout.get("width") or 700
    height = layout.get("height") or 450
    fig = Figure(figsize=(width / 100, height / 100), dpi=100)
    FigureCanvasAgg(fig)
    axes = {}  # (xaxis, yaxis) or ("domain", i) -> matplotlib axes
    skipped, drawn = [], 0
    barmode = layout.get("barmode") or "group"
    bars = {}  # axes key -> number of bar traces, for grouping
    for trace in figure.get("data") or []:
        if trace.get("type", "scatter") == "bar":
            key = (trace.get("xaxis", "x"), trace.get("yaxis", "y"))
            bars[key] = bars.get(key, 0) + 1
    bar_index, stacks, categories, previous_y = {}, {}, {}, {}

    def place(x0, x1, y0, y1):
        left, right, bottom, top = 0.1, 0.97, 0.12, 0.88 if _title(layout.get("title")) else 0.95
        w, h = right - left, top - bottom
        return fig.add_axes([left + x0 * w, bottom + y0 * h, (x1 - x0) * w * 0.98, (y1 - y0) * h * 0.95])

    def cartesian(trace):
        xa, ya = trace.get("xaxis", "x"), trace.get("yaxis", "y")
        key = (xa, ya)
        if key not in axes:
            xl = layout.get("xaxis" + xa[1:]) or {}
            yl = layout.get("yaxis" + ya[1:]) or {}
            ax = place(*(xl.get("domain") or [0, 1]), *(yl.get("domain") or [0, 1]))
            if _title(xl.get("title")):
                ax.set_xlabel(_title(xl.get("title")))
            if _title(yl.get("title")):
                ax.set_ylabel(_title(yl.get("title")))
            if xl.get("type") == "log":
                ax.set_xscale("log")
            if yl.get("type") == "log":
                ax.set_yscale("log")
            if yl.get("autorange") == "reversed":
                ax.invert_yaxis()
            ax.grid(True, alpha=0.3)
            axes[key] = ax
        return key, axes[key]

    def positions(key, values):
        """Bar positions: numbers and dates as they are, categories in order of appearance."""
        import numpy as np

        if isinstance(values, np.ndarray) and _numeric(values):
            return values
        order = categories.setdefault(key, {})
        for v in values:
            order.setdefault(str(v), len(order))
        return np.asarray([order[str(v)] for v in values])

    for i, trace in enumerate(figure.get("data") or []):
        kind = trace.get("type", "scatter")
        name = trace.get("name") if trace.get("showlegend", True) is not False else None
        marker = trace.get("marker") or {}
        line = trace.get("line") or {}
        color = next((c for c in (marker.get("color"), line.get("color")) if isinstance(c, str)),
                     colors[i % len(colors)])
        horizontal = trace.get("orientation") == "h"
        if kind in ("scatter", "scattergl"):
            key, ax = cartesian(trace)
            x, y = _array(trace.get("x")), _array(trace.get("y"))
            if y is None:
                skipped.append("a scatter trace without y")
                continue
            if x is None:
                x = list(range(len(y)))
            _dates(ax, x)
            mode = trace.get("mode") or ("lines+markers" if len(y) < 20 else "lines")
            if "lines" in mode:
                dash = {"dash": "--", "dot": ":", "dashdot": "-."}.get(line.get("dash"), "-")
                ax.plot(x, y, color=color, linestyle=dash, label=name,
                        linewidth=line.get("width") or 2)
                name = None
            if "markers" in mode:
                values = _array(marker.get("color")) if not isinstance(marker.get("color"), str) else None
                size = marker.get("size") if isinstance(marker.get("size"), (int, float)) else 6
                if values is not None and len(values) == len(y) and _numeric(values):
                    points = ax.scatter(x, y, c=values, s=size ** 2, cmap="viridis", label=name)
                    fig.colorbar(points, ax=ax)
                else:
                    ax.scatter(x, y, color=color, s=size ** 2, label=name)
            fill = trace.get("fill")
            if fill == "tozeroy":
                ax.fill_between(x, y, alpha=0.3, color=color)
            elif fill == "tonexty" and key in previous_y and len(previous_y[key]) == len(y):
                ax.fill_between(x, previous_y[key], y, alpha=0.3, color=color)
            previous_y[key] = y
        elif kind == "bar":
            key, ax = cartesian(trace)
            x, y = _array(trace.get("x")), _array(trace.get("y"))
            cats, values = (y, x) if horizontal else (x, y)
            if values is None:
                skipped.append("a bar trace without values")
                continue
            if cats is None:
                cats = list(range(len(values)))
            import numpy as np

            pos = np.asarray(positions(key, cats))
            n, k = bars[key], bar_index.get(key, 0)
            bar_index[key] = k + 1
            width = 0.8
            if barmode == "group" and n > 1 and pos.dtype.kind in "fiu":
                width = 0.8 / n
                pos = pos + (k - (n - 1) / 2) * width
            base = None
            if barmode in ("stack", "relative") and pos.dtype.kind in "fiu":
                # Rows at one position stack on each other too, as Plotly draws them.
                stack, base = stacks.setdefault(key, {}), []
                for p, v in zip(pos.tolist(), values.tolist()):
                    base.append(stack.get(p, 0.0))
                    stack[p] = base[-1] + float(v)
            draw = ax.barh if horizontal else ax.bar
            if horizontal:
                draw(pos, values, height=width, left=base, color=color, label=name)
            else:
                draw(pos, values, width=width, bottom=base, color=color, label=name)
            order = categories.get(key)
            if order:
                ticks = (ax.set_yticks if horizontal else ax.set_xticks)
                ticks(list(order.values()), list(order.keys()))
        elif kind == "histogram":
            key, ax = cartesian(trace)
            data = _array(trace.get("y") if horizontal else trace.get("x"))
            if data is None:
                skipped.append("a histogram without data")
                continue
            if _numeric(data):
                bins = trace.get("nbinsx") or trace.get("nbinsy") or "auto"
                ax.hist(data, bins=bins, color=color, alpha=0.75 if barmode == "overlay" else 1,
                        orientation="horizontal" if horizontal else "vertical", label=name)
            else:
                labels, counts = [], {}
                for v in data.tolist():
                    counts[str(v)] = counts.get(str(v), 0) + 1
                labels = list(counts)
                ax.bar(positions(key, labels), [counts[v] for v in labels], color=color, label=name)
                ax.set_xticks(list(categories[key].values()), list(categories[key].keys()))
        elif kind == "pie":
            domain = trace.get("domain") or {}
            ax = place(*(domain.get("x") or [0, 1]), *(domain.get("y") or [0, 1]))
            axes[("domain", i)] = ax
            labels = _array(trace.get("labels"))
            values = _array(trace.get("values"))
            if labels is not None:
                # Plotly sums the values of equal labels (counts them without values).
                sums = {}
                weights = values.tolist() if values is not None else [1] * len(labels)
                for label, v in zip(labels.tolist(), weights):
                    sums[str(label)] = sums.get(str(label), 0) + v
                labels, values = list(sums), list(sums.values())
            if values is None:
                skipped.append("a pie without values")
                continue
            hole = trace.get("hole") or 0
            pie_colors = marker.get("colors") or [colors[j % len(colors)] for j in range(len(values))]
            ax.pie(values, labels=None if labels is None else [str(v) for v in labels],
                   colors=pie_colors, autopct="%1.1f%%",
                   wedgeprops={"width": 1 - hole} if hole else None)
            ax.set_aspect("equal")
        elif kind in ("box", "violin"):
            key, ax = cartesian(trace)
            data = _array(trace.get("x") if horizontal else trace.get("y"))
            groups = _array(trace.get("y") if horizontal else trace.get("x"))
            if data is None:
                skipped.append(f"a {kind} without data")
                continue
            if groups is not None and len(groups) == len(data):
                by = {}
                for g, v in zip(groups.tolist(), data.tolist()):
                    by.setdefault(str(g), []).append(v)
                labels, samples = list(by), list(by.values())
            else:
                labels, samples = [name or str(i)], [data.tolist()]
            pos = positions(key, labels)
            if kind == "violin":
                parts = ax.violinplot(samples, positions=pos, vert=not horizontal)
                for body in parts["bodies"]:
                    body.set_color(color)
            else:
                ax.boxplot(samples, positions=pos, vert=not horizontal, patch_artist=True,
                           boxprops={"facecolor": color, "alpha": 0.6})
            ticks = ax.set_yticks if horizontal else ax.set_xticks
            ticks(list(categories[key].values()), list(categories[key].keys()))
        elif kind == "heatmap":
            key, ax = cartesian(trace)
            z = _array(trace.get("z"))
            if z is None or z.ndim != 2:
                skipped.append("a heatmap without a 2-D z")
                continue
            reversed_y = ((layout.get("yaxis" + trace.get("yaxis", "y")[1:]) or {})
                          .get("autorange") == "reversed")
            if reversed_y:
                ax.invert_yaxis()  # imshow's upper origin already puts row 0 on top
            image = ax.imshow(z.astype(float), aspect="auto", cmap="viridis",
                              origin="upper" if reversed_y else "lower")
            for labels, set_ticks in ((trace.get("x"), ax.set_xticks), (trace.get("y"), ax.set_yticks)):
                if isinstance(labels, list) and len(labels) <= 40:
                    set_ticks(range(len(labels)), [str(v) for v in labels])
            fig.colorbar(image, ax=ax)
        else:
            skipped.append(f"{kind} trace not drawn in the static image")
            continue
        drawn += 1
    if not drawn:
        return None, skipped
    for ax in axes.values():
        handles, _ = ax.get_legend_handles_labels()
        if handles and layout.get("showlegend", True) is not False:
            ax.legend(fontsize="small")
    title = _title(layout.get("title"))
    if title:
        fig.suptitle(title)
    if skipped:
        fig.text(0.01, 0.01, "not drawn: " + "; ".join(skipped), fontsize=7, color="#a00")
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue(), skipped


# --- Altair ---------------------------------------------------------------------------------


def _configure_altair(altair) -> None:
    major = altair.SCHEMA_VERSION.lstrip("v").split(".")[0]
    mime = f"application/vnd.vegalite.v{major}+json"
    vl_version = "_".join(altair.SCHEMA_VERSION.lstrip("v").split(".")[:2])

    def render(spec, **_metadata):
        bundle = {mime: spec}
        mark = spec.get("mark")
        mark = mark.get("type") if isinstance(mark, dict) else mark
        title = spec.get("title")
        title = title.get("text") if isinstance(title, dict) else title
        text = f"Altair chart{': ' + repr(title) if isinstance(title, str) else ''}" + (
            f", mark {mark}" if isinstance(mark, str) else "")
        try:
            import vl_convert

            # No external data is fetched for the image: the kernel's own requests go
            # through the egress policy, the renderer's would not.
            png = vl_convert.vegalite_to_png(
                spec, vl_version=vl_version, scale=2, allowed_base_urls=[]
            )
            bundle["image/png"] = base64.b64encode(png).decode()
        except Exception as err:  # noqa: BLE001 - the interactive chart still shows
            reason = " ".join(str(err).split()) or repr(err)
            text += f" (no static image: {reason[:200]})"
        bundle["text/plain"] = text
        return bundle

    altair.renderers.register(RENDERER, render)
    altair.renderers.enable(RENDERER)
