"""Training statistics: timed events from every worker, the scheduler and the client, on
the scheduler's clock; summaries per phase; JSON and self-contained HTML exports; the
live ``/dlspark`` page in the Dask dashboard.

With ``collect_training_stats=True`` on a master, ``trainer.training_stats`` is a
:class:`TrainingStats`.

Examples
--------
>>> stats = trainer.training_stats  # doctest: +SKIP
>>> print(stats.stats_as_string())  # doctest: +SKIP
>>> stats.export_html("report.html")  # doctest: +SKIP
"""

from ._summary import PHASES, TrainingStats, load_json

__all__ = ["TrainingStats", "load_json", "PHASES"]
