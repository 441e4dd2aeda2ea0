import pathlib
import runpy
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_digits_example_runs_and_learns(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_digits.py", "--epochs", "6", "--save", str(tmp_path / "n.dls")])
    mod = runpy.run_path(str(ROOT / "examples" / "train_digits.py"))
    acc = mod["main"](["--epochs", "6", "--save", str(tmp_path / "n.dls")])
    assert acc >= 0.93
    assert (tmp_path / "n.dls").exists()
    assert "test accuracy" in capsys.readouterr().out
