"""Bokeh figures of training statistics: the standalone HTML report and the live page.

Imported only when a report or the dashboard page is made (bokeh is optional:
``pip install dlspark[stats]``; the Dask dashboard needs it anyway).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["report_html", "report_layout", "live_document", "lane_names"]


def _bokeh():
    try:
        import bokeh  # noqa: F401
    except ImportError as e:
        raise ImportError("the HTML report and the dashboard page need bokeh: pip install 'dlspark[stats]'") from e


def _palette(n):
    from bokeh.palettes import Category20, Category20b, Category20c

    strong, light = list(Category20[20])[0::2], list(Category20[20])[1::2]
    b, c = list(Category20b[20]), list(Category20c[20])
    colours = strong + b[0::4] + b[2::4] + c[0::4] + c[2::4] + light  # 40, no repeats
    return [colours[i % len(colours)] for i in range(n)]


def lane_names(stats) -> list:
    """The timeline's lanes, one per worker and thread that recorded events (workers by
    address, then the scheduler's and the client's)."""
    seen = {(e["worker"], e.get("lane") or "main") for e in stats.events}
    workers = stats.workers()
    order = {w: i for i, w in enumerate(workers + ["scheduler", "client"])}
    lanes = sorted(seen, key=lambda wl: (order.get(wl[0], len(order)), wl[1] != "main", wl[1]))
    return [f"{_short(w)} · {lane}" for w, lane in lanes]


def _short(worker):
    return worker.replace("tcp://", "").replace("inproc://", "")


#: the statistics' instants of a fit's workers (``dlspark.distributed._messages.WORKER_EVENTS``), in words
WORKER_WORDS = {"worker_lost": "lost", "worker_joined": "joined", "worker_join_failed": "could not join",
                "worker_dropped": "dropped (a peer could not reach it)"}


def _worker_events(stats, job) -> str:
    """What happened to ``job``'s workers, as the report's list items."""
    events = sorted((e for e in stats.events if e["phase"] in WORKER_WORDS and e.get("job") == job["job"]),
                    key=lambda e: e["start"])
    return "".join(f"<li>worker <code>{e.get('peer')}</code> {WORKER_WORDS[e['phase']]} at "
                   f"{e['start'] - job['start']:.2f} s (round {e.get('round')})</li>" for e in events)


def _timeline(stats, phases, colours):
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure

    lanes = lane_names(stats)
    t0 = min((e["start"] for e in stats.events), default=0.0)
    data = {k: [] for k in ("lane", "left", "right", "phase", "ms", "round", "colour")}
    cmap = dict(zip(phases, colours))
    for e in stats.events:
        data["lane"].append(f"{_short(e['worker'])} · {e.get('lane') or 'main'}")
        data["left"].append(e["start"] - t0)
        data["right"].append(e["start"] - t0 + max(e["duration"], 0.0))
        data["phase"].append(e["phase"])
        data["ms"].append(e["duration"] * 1e3)
        data["round"].append(-1 if e.get("round") is None else e["round"])
        data["colour"].append(cmap[e["phase"]])
    src = ColumnDataSource(data)
    p = figure(y_range=list(reversed(lanes)), height=max(220, 34 * len(lanes) + 90), sizing_mode="stretch_width",
               title="Timeline (scheduler's clock; one lane per worker and thread)", x_axis_label="seconds",
               tools="xpan,xwheel_zoom,box_zoom,reset,save", name="timeline", min_border_left=24)
    p.hbar(y="lane", left="left", right="right", height=0.8, fill_color="colour", line_color=None, source=src,
           legend_field="phase")
    instants = [e for e in stats.events if e["phase"] in WORKER_WORDS]
    if instants:  # a worker lost, joined...: of length 0, a marker where the bars would not show
        p.scatter([e["start"] - t0 for e in instants],
                  [f"{_short(e['worker'])} · {e.get('lane') or 'main'}" for e in instants],
                  marker="inverted_triangle", size=13, color=[cmap[e["phase"]] for e in instants], line_color="black")
    p.add_tools(HoverTool(tooltips=[("phase", "@phase"), ("ms", "@ms{0.000}"), ("round", "@round"),
                                    ("lane", "@lane")]))
    p.legend.location = "top_left"
    p.legend.orientation = "horizontal"
    p.legend.nrows = max(1, -(-len(phases) // 12))  # at most 12 phases a row: the legend fits the width
    p.add_layout(p.legend[0], "below")
    p.legend.click_policy = "hide"
    return p


def _durations(stats, phases, colours):
    from bokeh.models import ColumnDataSource
    from bokeh.plotting import figure

    s = stats.summary()
    names = [ph for ph in phases if ph in s]
    src = ColumnDataSource({"phase": names, "mean": [s[n]["mean"] * 1e3 for n in names],
                            "p95": [s[n]["p95"] * 1e3 for n in names], "total": [s[n]["total"] for n in names],
                            "colour": [colours[phases.index(n)] for n in names]})
    p = figure(x_range=names, height=300, sizing_mode="stretch_width", title="Duration per phase: mean (bar), p95 (dash), ms",
               y_axis_type="log", tools="save,reset", name="durations")
    p.vbar(x="phase", top="mean", bottom=1e-3, width=0.7, fill_color="colour", line_color=None, source=src)
    p.scatter(x="phase", y="p95", marker="dash", size=18, line_width=2, color="black", source=src)
    p.xaxis.major_label_orientation = 0.8
    return p


def _histograms(stats, phases, colours):
    from bokeh.layouts import gridplot
    from bokeh.plotting import figure

    plots = []
    for ph, colour in zip(phases, colours):
        d = np.asarray([e["duration"] * 1e3 for e in stats.events if e["phase"] == ph], dtype=float)
        if len(d) < 2:
            continue
        hist, edges = np.histogram(d, bins=min(30, max(5, int(math.sqrt(len(d))))))
        p = figure(height=170, width=260, title=f"{ph} (n={len(d)}), ms", tools="save")
        p.quad(top=hist, bottom=0, left=edges[:-1], right=edges[1:], fill_color=colour, line_color=None)
        p.xaxis.ticker.desired_num_ticks = 4  # wide tick labels (10000, 20000) would run together
        plots.append(p)
    return gridplot(plots, ncols=4, toolbar_location=None) if plots else None


def _per_worker(stats):
    from bokeh.layouts import row
    from bokeh.models import ColumnDataSource
    from bokeh.plotting import figure

    per = stats.per_worker()
    ws = [_short(w) for w in per]
    src = ColumnDataSource({"worker": ws, "examples": [v["examples"] for v in per.values()],
                            "sent": [v["bytes_sent"] / 1e6 for v in per.values()],
                            "received": [v["bytes_received"] / 1e6 for v in per.values()]})
    a = figure(x_range=ws, height=260, width=420, title="Examples per worker", tools="save", name="examples")
    a.vbar(x="worker", top="examples", width=0.6, source=src, color="#1f77b4")
    b = figure(x_range=ws, height=260, width=420, title="MB sent (orange) and received (green) per worker",
               tools="save", name="bytes")
    from bokeh.transform import dodge

    b.vbar(x=dodge("worker", -0.17, range=b.x_range), top="sent", width=0.3, source=src, color="#ff7f0e")
    b.vbar(x=dodge("worker", 0.17, range=b.x_range), top="received", width=0.3, source=src, color="#2ca02c")
    return row(a, b)


def _loss(stats):
    from bokeh.plotting import figure

    rs = [r for r in stats.rounds if r.get("loss") is not None]
    p = figure(height=260, width=420, title="Loss per round", x_axis_label="round (all fits in order)",
               tools="save,reset,box_zoom", name="loss")
    x = list(range(1, len(rs) + 1))
    y = [float(r["loss"]) for r in rs]
    p.line(x, y, line_width=2)
    p.scatter(x, y, size=5)
    return p


def _sharing(stats):
    from bokeh.layouts import row
    from bokeh.plotting import figure

    enc = [e for e in stats.events if e["phase"] == "encode" and "threshold" in e]
    if not enc:
        return None
    figs = []
    for key, title, log in (("threshold", "Threshold per step", True), ("sparsity", "Sparsity per step", True),
                            ("bytes", "Message bytes per step", False)):
        p = figure(height=240, width=330, title=title, x_axis_label="step", tools="save,reset,box_zoom",
                   y_axis_type="log" if log else "linear", name=f"sharing_{key}")
        for w, colour in zip(stats.workers(), _palette(len(stats.workers()))):
            pts = [(e["step"], e[key]) for e in enc if e["worker"] == w and e.get(key, 0) > 0]
            if pts:
                xs, ys = zip(*pts)
                p.scatter(list(xs), list(ys), size=4, color=colour, legend_label=_short(w))
        if p.legend:  # under the plot, not over its points
            p.add_layout(p.legend[0], "below")
        figs.append(p)
    return row(*figs)


def report_layout(stats):
    """The report's bokeh layout (see :meth:`TrainingStats.export_html`)."""
    _bokeh()
    from bokeh.layouts import column, row
    from bokeh.models import Div

    phases = sorted({e["phase"] for e in stats.events})
    colours = _palette(len(phases))
    jobs = "".join(f"<li>fit <code>{j['job']}</code> ({j.get('algorithm', '?')}): {j['end'] - j['start']:.2f} s, "
                   f"{len(j.get('workers', ()))} workers" + (f"<ul>{w}</ul>" if (w := _worker_events(stats, j)) else "")
                   + "</li>" for j in stats.jobs)
    head = Div(text=f"<h1>dlspark training statistics</h1><ul>{jobs}</ul>"
                    f"<p>{len(stats.rounds)} rounds, {len(stats.events)} events; clocks aligned to the "
                    f"scheduler's within {stats.clock_error() * 1e3:.3f} ms.</p>", sizing_mode="stretch_width")
    parts = [head]
    if stats.events:
        parts += [_timeline(stats, phases, colours), _durations(stats, phases, colours)]
        h = _histograms(stats, phases, colours)
        if h is not None:
            parts += [Div(text="<h3>Durations per phase</h3>"), h]
    parts.append(row(_loss(stats), _per_worker(stats)) if stats.events else _loss(stats))
    s = _sharing(stats)
    if s is not None:
        parts += [Div(text="<h3>Gradient sharing</h3>"), s]
    return column(*parts, sizing_mode="stretch_width")


def report_html(stats, title: str = "dlspark training statistics") -> str:
    """One HTML document holding everything (bokeh's scripts inlined: it opens with no network)."""
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    return file_html(report_layout(stats), INLINE, title)


# -- the live page ---------------------------------------------------------------------------
#: the job machine's events about a worker, in the live page's words
_LIVE_WORDS = {"lost": "lost in round {round}", "joined": "joined after round {round}",
               "join-failed": "could not join after round {round}", "partitioned": "dropped after round {round}: "
               "a peer could not reach it"}


def _live_events(events, last: int = 8) -> str:
    """The latest of ``events`` (what happened to the job's workers) as list items."""
    return "".join(f"<li>worker <code>{e.get('worker')}</code> {_LIVE_WORDS[e['event']].format(round=e.get('round'))}"
                   f"</li>" for e in events[-last:] if e.get("event") in _LIVE_WORDS)


def live_document(page, doc):
    """Fill a bokeh server document with the running job's figures, refreshed twice a second."""
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, Div
    from bokeh.plotting import figure

    from ._rounds import _PHASE_COLUMNS, round_table, worker_rates

    rounds_src = ColumnDataSource(round_table([]), name="rounds_data")
    rates_src = ColumnDataSource(worker_rates([]), name="rates_data")
    head = Div(text="<h2>dlspark: no job yet</h2>", name="head")
    loss = figure(height=260, width=420, title="Loss per round", tools="save,reset", name="loss")
    loss.line("round", "loss", source=rounds_src, line_width=2)
    rates = figure(x_range=[], height=260, width=420, title="Steps/s per worker", tools="save", name="rates")
    rates.vbar(x="worker", top="steps_per_s", width=0.6, source=rates_src)
    split = figure(height=260, width=420, title="Round time split into phases (s)", tools="save", name="phases")
    split.vbar_stack(list(_PHASE_COLUMNS), x="round", width=0.8, source=rounds_src, color=_palette(4),
                     legend_label=list(_PHASE_COLUMNS))
    wire = figure(height=260, width=420, title="Bytes on the wire per round", tools="save", name="bytes")
    wire.vbar(x="round", top="bytes", width=0.8, source=rounds_src, color="#2ca02c")
    thr = figure(height=260, width=420, title="Threshold (gradient sharing)", tools="save", name="threshold",
                 y_axis_type="log")
    thr.line("round", "threshold", source=rounds_src, line_width=2, color="#d62728")
    doc.title = "dlspark"
    doc.add_root(column(head, row(loss, rates, split), row(wire, thr)))
    seen = {"job": None, "n": -1, "events": -1}

    def refresh():
        job = page.latest()
        events = job.get("events", []) if job is not None else []
        if job is None or (job["job"] == seen["job"] and len(job["rounds"]) == seen["n"]
                           and len(events) == seen["events"]):
            return
        seen.update(job=job["job"], n=len(job["rounds"]), events=len(events))
        rounds = list(job["rounds"])
        rounds_src.data = round_table(rounds)
        r = worker_rates(rounds)
        rates.x_range.factors = [_short(w) for w in r["worker"]]
        rates_src.data = {"worker": [_short(w) for w in r["worker"]], "steps_per_s": r["steps_per_s"]}
        training = events[-1].get("workers", len(job["workers"])) if events else len(job["workers"])
        head.text = (f"<h2>dlspark job {job['job']} ({job['algorithm']}): {len(rounds)} rounds on "
                     f"{training} workers</h2>" + (f"<ul>{_live_events(events)}</ul>" if events else ""))

    refresh()
    doc.add_periodic_callback(refresh, 500)
