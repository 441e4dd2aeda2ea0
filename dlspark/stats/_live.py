"""The live page ``/dlspark`` in the Dask dashboard: the running job's loss, steps/s per
worker, each round's time split into phases, bytes on the wire, for gradient sharing
the threshold, and the workers lost or joined.

The scheduler plugin keeps every round's record here as the job machine emits it
(:class:`LivePage`, a few dicts, whether or not a dashboard runs). When the
scheduler serves Dask's bokeh dashboard, :meth:`LivePage.install` adds a bokeh
application at ``/dlspark`` beside it, the way ``distributed.dashboard.scheduler``
connects its own pages; bokeh is imported only then.
"""

from __future__ import annotations

import collections
import logging

from ._rounds import _PHASE_COLUMNS, round_table, worker_rates  # noqa: F401  (the page's data)

__all__ = ["LivePage", "dashboard_link", "round_table"]

logger = logging.getLogger(__name__)

ROUTE = "/dlspark"


class LivePage:
    """The running jobs' round records, kept for the ``/dlspark`` page."""

    def __init__(self):
        self.jobs: collections.OrderedDict = collections.OrderedDict()
        self.app = None

    @classmethod
    def install(cls, scheduler) -> "LivePage":
        page = cls()
        apps = getattr(getattr(scheduler, "http_application", None), "applications", [])
        dashboards = [a for a in apps if type(a).__name__.endswith("BokehTornado")]
        if dashboards:
            try:
                page._serve(scheduler, dashboards[0])
            except Exception:  # the page is a convenience: a job must not fail for it
                logger.exception("dlspark: could not add the /dlspark page to the dashboard")
        return page

    def _serve(self, scheduler, dashboard):
        from distributed.dashboard.core import BokehApplication
        from tornado.ioloop import IOLoop

        from ._pages import live_document

        prefix = getattr(dashboard, "prefix", "") or ""

        def make(server, extra, doc):
            live_document(self, doc)

        self.app = BokehApplication({ROUTE: make}, scheduler, prefix=prefix)
        scheduler.http_application.add_application(self.app)
        self.app.initialize(IOLoop.current())
        self.app.start()

    def job_started(self, job, master, workers):
        self.jobs[job] = {"job": job, "algorithm": master.name, "workers": list(workers), "rounds": [], "events": []}
        while len(self.jobs) > 8:
            self.jobs.popitem(last=False)

    def round_done(self, job, stat):
        if job in self.jobs:
            self.jobs[job]["rounds"].append(stat)

    def worker_event(self, job, msg):
        """A worker of ``job`` lost, joined, that could not join or was dropped (the job
        machine's event)."""
        if job in self.jobs:
            self.jobs[job]["events"].append(msg)

    def latest(self):
        return next(reversed(self.jobs.values()), None)


def dashboard_link(client) -> str | None:
    """The ``/dlspark`` page's URL on ``client``'s scheduler, or None without a dashboard."""
    try:
        link = client.dashboard_link
    except Exception:
        return None
    if not link:
        return None
    base = link.rsplit("/", 1)[0] if link.endswith("/status") else link.rstrip("/")
    return base + ROUTE
