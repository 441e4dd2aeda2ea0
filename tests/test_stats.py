"""Training statistics (dlspark.stats): summaries on known events, clock alignment, and
2-worker jobs of both algorithms on a real cluster where one worker's clock is shifted,
with the HTML report and the dashboard's live page rendered in a real headless chromium.

The cluster: a LocalCluster of one worker process (its scheduler serving Dask's
dashboard on a free port) plus a second worker process started with its wall clock
37.5 s ahead (``time.time`` offset before Dask starts in that process, as a machine
whose clock is off would have it). Every job below runs on both.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from html.parser import HTMLParser

import numpy as np
import pytest

import dlspark
from dlspark.stats import PHASES, TrainingStats, load_json
from dlspark.stats._clock import Clock, best_offset
from dlspark.stats._recorder import Recorder

from _chromium import render
from conftest import MLP, slow_loader

SHIFT = 37.5  # seconds the second worker's clock is ahead
LOAD_DELAY = 0.2  # s per minibatch file: rounds of ~0.8 s, where the orders' transit stays under 5% on a loaded machine


_SHIFTED_WORKER = textwrap.dedent(f"""
    import sys, time
    _wall = time.time
    time.time = lambda: _wall() + {SHIFT!r}  # before Dask and JAX read the clock
    from distributed.cli.dask_worker import main
    sys.argv = ["dask-worker", sys.argv[1], "--nthreads", "1", "--no-nanny", "--name", "shifted",
                "--no-dashboard"]
    main()
""")


# -- summaries and clocks on known inputs ---------------------------------------------------
def _known_stats():
    ev = []
    for i, ms in enumerate([1.0, 2.0, 3.0, 4.0]):
        ev.append({"phase": "fit", "start": 100.0 + i, "duration": ms / 1e3, "worker": "w1", "lane": "main",
                   "round": 1, "job": "j", "examples": 32})
    ev.append({"phase": "fetch", "start": 105.0, "duration": 0.010, "worker": "w2", "lane": "main", "round": 1,
               "job": "j", "bytes": 1000})
    ev.append({"phase": "serve", "start": 105.0, "duration": 0.0, "worker": "w1", "lane": "comms", "round": 1,
               "job": "j", "bytes": 1000})
    clocks = {"j": {"w1": Clock({"offset": 0.5, "error": 2e-4, "at": 0.0},
                                {"offset": 0.5001, "error": 1e-4, "at": 10.0}).as_dict()}}
    jobs = [{"job": "j", "algorithm": "averaging", "start": 99.0, "end": 106.0, "workers": ["w1", "w2"]}]
    return TrainingStats([{"round": 1, "loss": 2.0}], ev, clocks, jobs)


def test_summary_per_phase_on_known_events():
    s = _known_stats().summary()
    fit = s["fit"]
    assert fit["count"] == 4
    assert fit["mean"] == pytest.approx(2.5e-3)
    assert fit["p50"] == pytest.approx(2.5e-3)
    assert fit["p95"] == pytest.approx(3.85e-3)  # linear interpolation: 3 + 0.85 * (4 - 3) ms
    assert fit["total"] == pytest.approx(10e-3)
    assert s["fetch"] == {"count": 1, "mean": 0.01, "p50": 0.01, "p95": 0.01, "total": 0.01}
    assert set(_known_stats().summary(worker="w2")) == {"fetch"}
    assert _known_stats().per_worker() == {"w1": {"examples": 128, "bytes_sent": 1000, "bytes_received": 0, "steps": 4},
                                           "w2": {"examples": 0, "bytes_sent": 0, "bytes_received": 1000, "steps": 0}}


def test_stats_as_string_on_known_events():
    text = _known_stats().stats_as_string()
    lines = text.splitlines()
    assert lines[0] == "dlspark training statistics: 1 fits, 1 rounds, 2 workers, 6 events"
    assert "fit j (averaging): 7.000 s on 2 workers" in lines
    assert "clocks aligned to the scheduler's within 0.200 ms" in lines
    assert "  w1: offset +500.000 ms, drift +0.100 ms, error 0.200 ms" in lines
    row = [ln for ln in lines if ln.startswith("fit ") and "averaging" not in ln][0].split()
    assert row == ["fit", "4", "2.500", "2.500", "3.850", "0.010"]


def test_rounds_read_as_a_list():
    s = _known_stats()
    assert len(s) == 1 and s[0]["loss"] == 2.0 and [r["round"] for r in s] == [1]
    assert not TrainingStats() and len(TrainingStats()) == 0


def test_to_dataframe(tmp_path):
    df = _known_stats().to_dataframe()
    assert len(df) == 6
    assert list(df.columns[:7]) == ["phase", "start", "duration", "worker", "lane", "round", "job"]
    assert df.groupby("phase")["duration"].sum()["fit"] == pytest.approx(0.01)


@pytest.mark.parametrize("base", ["memory://stats-test", "file"])
def test_json_round_trip(tmp_path, base):
    url = f"{tmp_path}/s.json" if base == "file" else f"{base}/s.json"
    s = _known_stats()
    s.export_json(url)
    back = load_json(url)
    assert back.events == s.events and back.rounds == s.rounds and back.clocks == s.clocks and back.jobs == s.jobs
    assert back.stats_as_string() == s.stats_as_string()


def test_json_is_strict_with_a_nan_loss(tmp_path):
    # a round whose losses were all skipped (on_nonfinite="skip") has a NaN loss: written so
    # that strict JSON parsers (JavaScript's JSON.parse among them) read the file
    s = _known_stats()
    s.rounds[0]["loss"] = float("nan")
    s.rounds += [{"round": 2, "loss": 1.5}, {"round": 3, "loss": float("-inf")}]
    url = str(tmp_path / "s.json")
    s.export_json(url)

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    json.loads(open(url).read(), parse_constant=refuse)
    back = load_json(url)
    assert math.isnan(back.rounds[0]["loss"]) and back.rounds[-1]["loss"] == float("-inf")
    assert back.rounds[1:-1] == s.rounds[1:-1] and back.events == s.events


def test_load_json_rejects_other_files(tmp_path):
    p = tmp_path / "other.json"
    p.write_text(json.dumps({"rounds": []}))
    with pytest.raises(ValueError, match="format 'dlspark-training-stats'"):
        load_json(str(p))


def test_best_offset_keeps_the_shortest_round_trip():
    # remote clock 10 s ahead; the second exchange is the tightest
    m = best_offset([(0.0, 10.9, 1.0), (2.0, 12.004, 2.006), (3.0, 13.3, 3.4)])
    assert m["offset"] == pytest.approx(10.001) and m["error"] == pytest.approx(0.003)
    c = Clock({"offset": 1.0, "error": 0.001, "at": 100.0}, {"offset": 1.2, "error": 0.002, "at": 200.0})
    assert c.offset_at(150.0) == pytest.approx(1.1)  # drift interpolated
    assert c.to_scheduler(150.0) == pytest.approx(148.9)
    assert c.error == 0.002 and c.drift == pytest.approx(0.2)


def test_recorder_tiles_an_order_and_takes_compilation_out():
    import threading

    import jax
    import jax.numpy as jnp

    rec = Recorder()
    rec.start_idle()
    time.sleep(0.01)
    rec.begin_order(round=3)
    box = {}

    def on_thread():  # compiled on a bound thread, as on a run's compute thread
        rec.bind()
        time.sleep(0.005)
        rec.mark("data_wait")
        f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + box.setdefault("salt", np.float32(time.time() % 1)))
        f(jnp.ones(7)).block_until_ready()
        rec.mark("fit", examples=7)
        rec.unbind()

    t = threading.Thread(target=on_thread)
    t.start()
    t.join()
    rec.end_order()
    ev = rec.drain()
    phases = [e[0] for e in ev]
    assert phases[0] == "idle" and ev[0][4] is None and ev[0][2] >= 0.009  # between rounds: in none
    assert "compile" in phases and phases[-1] == "control"
    main = [e for e in ev if e[0] != "compile" and e[0] != "idle"]
    assert all(e[4] == 3 for e in main)
    compiled = sum(e[2] for e in ev if e[0] == "compile")
    assert compiled > 0
    # the order's phases plus its compilation cover it exactly: no gap, no overlap
    span = main[-1][1] + main[-1][2] - (main[0][1])
    assert sum(e[2] for e in main) + compiled == pytest.approx(span, abs=1e-6)
    fit = [e for e in ev if e[0] == "fit"][0]
    assert fit[5] == {"examples": 7}


def test_null_recorder_costs_nothing_and_keeps_nothing():
    from dlspark.stats._recorder import NULL

    NULL.begin_order(1)
    NULL.mark("fit", examples=3)
    with NULL.span("x"):
        pass
    NULL.end_order()
    assert NULL.drain() == [] and not NULL.on


# -- a real cluster with a shifted clock -------------------------------------------------------
@pytest.fixture(scope="module")
def shifted_client():
    from distributed import Client

    from dlspark.cluster import WORKER_ENV, local_cluster

    cluster = local_cluster(1, dashboard_address="127.0.0.1:0")
    env = {**os.environ, **WORKER_ENV, "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what spawned workers are given
    proc = subprocess.Popen([sys.executable, "-c", _SHIFTED_WORKER, cluster.scheduler_address], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = Client(cluster)
    try:
        client.wait_for_workers(2, timeout=120)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)
        cluster.close()


@pytest.fixture(scope="module")
def minibatch_paths(tmp_path_factory, digits):
    d = tmp_path_factory.mktemp("stats-mb")
    ds = digits[0]
    return dlspark.data.save_minibatches(ds.features[:768], ds.labels[:768], str(d), batch_size=32)


@pytest.fixture(scope="module")
def fits(shifted_client, minibatch_paths, tmp_path_factory):
    """One 2-worker fit of each algorithm with statistics on: 24 minibatches, 3 rounds."""
    import optax

    ds = dlspark.datasets.digits()[0]
    model = dlspark.Model.from_flax(MLP(), ds.features[:1])
    ck = str(tmp_path_factory.mktemp("stats-ck") / "ck.dls")
    out = {}
    for master, kw in ((dlspark.ParameterAveraging(batch_size_per_worker=32, averaging_frequency=4,
                                                   collect_training_stats=True),
                        {"checkpoint_every": 3, "checkpoint_url": ck}),
                       (dlspark.GradientSharing(batch_size_per_worker=32, steps_per_round=4,
                                                collect_training_stats=True), {})):
        net = dlspark.Network(model, loss="softmax_cross_entropy", updater=optax.adam(1e-2), seed=0)
        trainer = dlspark.DistributedTrainer(shifted_client, net, master, progress=False)
        trainer.fit_paths(minibatch_paths, epochs=1, loader=slow_loader(LOAD_DELAY), **kw)
        out[master.name] = trainer
    return out


def _shifted(client):
    return next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "shifted")


WORKER_PHASES = {
    "averaging": {"setup", "compile", "data_wait", "load", "fit", "prepare", "fetch", "average", "serve", "idle",
                  "control"},
    "sharing": {"setup", "compile", "data_wait", "load", "fit", "wait_peers", "encode", "send", "decode", "apply",
                "threshold", "push", "receive", "sync", "idle", "control"},
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_every_phase_for_every_worker(fits, algorithm):
    s = fits[algorithm].training_stats
    assert len(s.workers()) == 2
    for w in s.workers():
        assert WORKER_PHASES[algorithm] <= set(s.phases(w)), (w, WORKER_PHASES[algorithm] - set(s.phases(w)))
    assert set(s.phases()) <= set(PHASES)
    assert {"round", "order", "plan"} <= set(s.phases("scheduler"))
    assert {"broadcast", "start", "wait", "fetch_state", "clock"} <= set(s.phases("client"))
    if algorithm == "averaging":  # the checkpoint is written by one worker
        assert len({e["worker"] for e in s.select(phase="checkpoint")}) == 1
    per = s.per_worker()
    assert sum(v["examples"] for v in per.values()) == 768
    assert all(v["bytes_sent"] > 0 and v["bytes_received"] > 0 for v in per.values())
    if algorithm == "sharing":
        enc = s.select(phase="encode")
        assert all(e["threshold"] > 0 and 0 <= e["sparsity"] <= 1 for e in enc)
        assert len(enc) == 24  # one per step


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_main_lane_adds_up_to_the_round(fits, algorithm):
    # The round lasts until its last worker answers: that worker's main lane adds up to it, and
    # no worker's lane is longer. (A worker that finishes its own part of the round sooner,
    # say by compiling its first mean faster, ends its lane before the round ends.)
    s = fits[algorithm].training_stats
    assert len(s) == 3
    phases = {w: s.round_phases(w) for w in s.workers()}
    for r in s:
        totals = {w: sum(p[r["round"]].values()) for w, p in phases.items()}
        assert max(totals.values()) == pytest.approx(r["round_time"], rel=0.05), (r["round"], totals, phases)
        assert all(t <= 1.05 * r["round_time"] for t in totals.values()), (r["round"], totals)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_event_times_inside_the_job_window(fits, algorithm):
    s = fits[algorithm].training_stats
    job = s.jobs[0]
    err = s.clock_error()
    assert err < 0.02
    for e in s.events:
        assert job["start"] - err <= e["start"] and e["start"] + e["duration"] <= job["end"] + err, e


@pytest.mark.slow
def test_a_shifted_clock_lines_up(fits, shifted_client):
    shifted = _shifted(shifted_client)
    for trainer in fits.values():
        s = trainer.training_stats
        job = s.jobs[0]["job"]
        c = s.clocks[job][shifted]
        # the clock's offset is found to within its stated error, at the start and at the end
        assert c["start"]["offset"] == pytest.approx(SHIFT, abs=c["start"]["error"] + 1e-4)
        assert c["end"]["offset"] == pytest.approx(SHIFT, abs=c["end"]["error"] + 1e-4)
        err = s.clock_error()
        # each fit order's round trip, on the scheduler's clock, holds what the worker did for it
        orders = [e for e in s.select(phase="order", worker="scheduler") if e["op"] == "fit" and e["to"] == shifted]
        assert len(orders) == 3
        for o in orders:
            steps = s.select(worker=shifted, lane="main", round=o["round"])
            steps = [e for e in steps if e["phase"] in ("data_wait", "fit")]
            assert steps
            assert o["start"] - err <= min(e["start"] for e in steps)
            assert max(e["start"] + e["duration"] for e in steps) <= o["start"] + o["duration"] + err


# -- the HTML report in a real browser ---------------------------------------------------------
class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links = []
        self.inline_json = []
        self._json = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href"):
            if a.get(k) is not None:
                self.links.append(a[k])
        self._json = tag == "script" and a.get("type") == "application/json"

    def handle_data(self, data):
        if self._json and data.strip():
            self.inline_json.append(data)

    def handle_endtag(self, tag):
        self._json = False


def _factor_ranges(node, out):
    if isinstance(node, dict):
        if node.get("name") == "FactorRange" and isinstance(node.get("attributes"), dict):
            out.append(node["attributes"].get("factors"))
        for v in node.values():
            _factor_ranges(v, out)
    elif isinstance(node, list):
        for v in node:
            _factor_ranges(v, out)
    return out


def _errors(messages):
    return [m for m in messages if m[0] in ("error", "exception", "assert")]


def _distinct_colours(png):
    from PIL import Image

    with Image.open(png) as im:
        pixels = np.asarray(im.convert("RGB").resize((350, 600))).reshape(-1, 3)
    return len(np.unique(pixels, axis=0))


@pytest.mark.slow
def test_html_report_in_a_browser(fits, tmp_path):
    s = TrainingStats()
    for trainer in fits.values():
        s.add(trainer.training_stats)
    html_path = tmp_path / "report.html"
    s.export_html(str(html_path))
    text = html_path.read_text()
    parser = _Links()
    parser.feed(text)
    off = [u for u in parser.links if not (u.startswith("#") or u.startswith("data:"))]
    assert off == [], f"links off the file: {off}"
    assert "cdn.bokeh.org" not in text
    # the timeline: one main lane per worker (and a lane per thread that recorded)
    factors = _factor_ranges([json.loads(j) for j in parser.inline_json], [])
    lanes = max(factors, key=lambda f: sum("· main" in x for x in f))
    workers = s.workers()
    assert sorted(x for x in lanes if x.endswith("· main") and not x.startswith(("scheduler", "client"))) == \
        sorted(w.replace("tcp://", "") + " · main" for w in workers)
    png = tmp_path / "report.png"
    rendered, messages = render(html_path.as_uri(), str(png))
    assert rendered, messages  # bokeh built every view of the document
    assert _errors(messages) == [], messages
    assert _distinct_colours(png) > 20
    docs = os.environ.get("DLSPARK_STATS_SCREENSHOT")
    if docs:  # the README's picture: DLSPARK_STATS_SCREENSHOT=docs/stats-report.png
        shutil.copy(png, docs)


@pytest.mark.slow
def test_cli_stats(fits, tmp_path):
    s = fits["averaging"].training_stats
    src = tmp_path / "s.json"
    s.export_json(str(src))
    out = tmp_path / "cli.html"
    from click.testing import CliRunner

    from dlspark.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["stats", str(src), "--html", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(s.stats_as_string())
    assert out.exists() and "Timeline" in out.read_text()
    bad = runner.invoke(main, ["stats", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and "no such file" in bad.output


# -- the live page in the Dask dashboard ---------------------------------------------------------
def test_the_live_page_names_the_workers_lost_and_joined():
    from bokeh.document import Document

    from dlspark.stats._live import LivePage
    from dlspark.stats._pages import live_document

    page = LivePage()
    page.job_started("j1", dlspark.ParameterAveraging(), ["tcp://a:1", "tcp://b:1"])
    page.worker_event("j1", {"event": "lost", "worker": "tcp://b:1", "workers": 1, "round": 4})
    heads = []
    for event in ({"event": "joined", "worker": "tcp://c:1", "workers": 2, "round": 4}, None):
        doc = Document()
        live_document(page, doc)  # as the page is opened
        heads.append(doc.get_model_by_name("head").text)
        if event:
            page.worker_event("j1", event)
    assert "0 rounds on 1 workers" in heads[0] and "<li>worker <code>tcp://b:1</code> lost in round 4</li>" in heads[0]
    assert "0 rounds on 2 workers" in heads[1] and heads[1].endswith(
        "<li>worker <code>tcp://b:1</code> lost in round 4</li><li>worker <code>tcp://c:1</code> joined after round "
        "4</li></ul>")
    page.worker_event("other", {"event": "lost", "worker": "tcp://a:1"})  # a job the page no longer keeps: ignored


@pytest.mark.slow
def test_live_page(fits, shifted_client, tmp_path):
    from bokeh.client import pull_session

    from dlspark.stats._live import dashboard_link

    url = dashboard_link(shifted_client)
    assert url and url.endswith("/dlspark")
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        page = resp.read().decode()
    assert "bokeh" in page.lower()
    # the page's document, as the browser's websocket gets it: the last job's rounds
    last = fits["sharing"]
    with pull_session(url=url) as session:
        doc = session.document
        rounds = doc.get_model_by_name("rounds_data").data
        rates = doc.get_model_by_name("rates_data").data
    assert rounds["round"] == [r["round"] for r in last.training_stats]
    assert np.allclose(rounds["loss"], [r["loss"] for r in last.training_stats])
    assert all(t > 0 for t in rounds["threshold"])
    assert sorted(rates["worker"]) == sorted(w.replace("tcp://", "") for w in last.training_stats.workers())
    assert all(x > 0 for x in rates["steps_per_s"])
    png = tmp_path / "live.png"
    rendered, messages = render(url, str(png), height=620)
    assert rendered, messages
    assert _errors(messages) == [], messages
    assert _distinct_colours(png) > 20
    docs = os.environ.get("DLSPARK_STATS_LIVE_SCREENSHOT")
    if docs:  # the README's picture: DLSPARK_STATS_LIVE_SCREENSHOT=docs/stats-live.png
        shutil.copy(png, docs)
