import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _main():
    return runpy.run_path(str(ROOT / "examples" / "train_digits.py"))["main"]


def test_digits_example_runs_locally_and_learns(tmp_path, capsys):
    acc = _main()(["--local", "--epochs", "6", "--save", str(tmp_path / "n.dls")])
    assert acc >= 0.93
    assert (tmp_path / "n.dls").exists()
    assert "test accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_digits_example_trains_on_the_embedded_cluster(capsys):
    acc = _main()(["--epochs", "8"])
    assert acc >= 0.95
    out = capsys.readouterr().out
    assert "Confusion matrix" in out
    # the embedded cluster's dashboard is on (a free port) and its /dlspark page is named once
    links = re.findall(r"dlspark: the running job's figures at (\S+)", out)
    assert len(links) == 1 and re.fullmatch(r"http://[\w.\-]+:\d+/dlspark", links[0]), out
