"""``dlspark stats FILE.json [--html OUT.html]``: read saved training statistics."""

from __future__ import annotations

import click

__all__ = ["stats_command"]


@click.command("stats")
@click.argument("file")
@click.option("--html", "html", metavar="OUT.html", default=None,
              help="Also write the self-contained HTML report to this path or URL.")
def stats_command(file, html):
    """Print the summary of training statistics saved with export_json (FILE: a path or any fsspec URL)."""
    from ._summary import TrainingStats

    try:
        stats = TrainingStats.load_json(file)
    except FileNotFoundError:
        raise click.BadParameter(f"no such file: {file}", param_hint="FILE") from None
    except ValueError as e:
        raise click.BadParameter(f"{file}: {e}", param_hint="FILE") from None
    click.echo(stats.stats_as_string())
    if html:
        stats.export_html(html)
        click.echo(f"HTML report written to {html}")
