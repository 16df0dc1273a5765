"""python -m dpwa: the subcommand registry, plot and status, on run folders written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from dpwa import cli
from dpwa.cluster.plot import draw, load_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def dpwa(*args):
    return subprocess.run(
        [sys.executable, "-m", "dpwa", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def write_run(run_dir, nodes=("w1", "w2")):
    """A run folder with metrics of known values (loss 1/step, accuracy rising), and one cut-off line."""
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "pids").mkdir()
    for k, node in enumerate(nodes):
        lines = [{"kind": "start", "t": 100.0 + k, "node": node, "epochs": 2}]
        for step in range(1, 5):
            lines.append(
                {
                    "kind": "step",
                    "t": 100.0 + step,
                    "node": node,
                    "epoch": 1 + step // 3,
                    "step": step,
                    "loss": 1.0 / step,
                    "exchanges_per_s": 2.0,
                    "averaged": step,
                    "failed": 0,
                }
            )
        lines += [
            {"kind": "eval", "t": 103.0, "node": node, "epoch": 1, "test_acc": 0.6},
            {"kind": "eval", "t": 105.0, "node": node, "epoch": 2, "test_acc": 0.9},
        ]
        text = "".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "step", "t": 10'
        (run_dir / "metrics" / f"{node}.jsonl").write_text(text)
        (run_dir / "pids" / f"{node}.pid").write_text("999999999 1\n")  # no such process
    return run_dir


def test_load_metrics_skips_the_cut_off_line(tmp_path):
    metrics = load_metrics(write_run(tmp_path / "run"))
    assert sorted(metrics) == ["w1", "w2"]
    assert [r["kind"] for r in metrics["w1"]] == ["start"] + ["step"] * 4 + ["eval"] * 2


@pytest.mark.io
def test_draw_writes_a_png_and_shows_the_average_when_known(tmp_path):
    run_dir = write_run(tmp_path / "run")
    (run_dir / "summary.json").write_text(json.dumps({"average": {"test_acc": 0.95, "test_loss": 0.2}}))
    path = draw(run_dir)
    assert path == run_dir / "curves.png" and path.read_bytes()[:8] == PNG
    other = draw(run_dir, tmp_path / "elsewhere.png")
    assert other.read_bytes()[:8] == PNG


def test_plot_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        load_metrics(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/metrics: no metrics files"):
        load_metrics(tmp_path / "empty")


@pytest.mark.slow
def test_python_m_dpwa_plot_redraws_and_reports_errors(tmp_path):
    run_dir = write_run(tmp_path / "run")
    done = dpwa("plot", run_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(run_dir / "curves.png") and (run_dir / "curves.png").read_bytes()[:8] == PNG
    missing = dpwa("plot", tmp_path / "nope")
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"dpwa plot: {tmp_path / 'nope'}: no such run folder"
    assert dpwa("frobnicate").returncode == 2  # argparse: unknown subcommand


def test_help_lists_every_subcommand_with_its_docstring(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "plot" in text and "Draw a run's loss and accuracy curves" in text
    assert "status" in text
    assert "dashboard" in text and "Serve a live web page of a cluster" in text


@pytest.mark.io
def test_dashboard_errors_name_what_is_wrong(tmp_path):
    missing = dpwa("dashboard", tmp_path / "nope")
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"dpwa dashboard: {tmp_path / 'nope'}: no such config file or run folder"
    run_dir = write_run(tmp_path / "run")
    no_config = dpwa("dashboard", run_dir)
    assert no_config.returncode == 1 and "not a run folder (no config.yaml in it)" in no_config.stderr
    assert "--every takes at least 0.1 seconds" in dpwa("dashboard", run_dir, "--every", "0").stderr


def test_a_new_subcommand_is_one_decorated_function(capsys):
    @cli.subcommand(cli.arg("words", nargs="+"))
    def echo_twice(args):
        """Print the words twice (test only)."""
        print(" ".join(args.words * 2))
        return 7

    try:
        assert cli.main(["echo-twice", "a", "b"]) == 7
        assert capsys.readouterr().out == "a b a b\n"
    finally:
        del cli._COMMANDS["echo-twice"]


def test_status_shows_the_table_and_that_nothing_runs(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run")
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["node", "state", "epoch"]
    assert out[1].split()[:4] == ["w1", "training", "2/2", "4"] and "90.00%" in out[1]
    assert out[-1] == "running: nothing"
    assert cli.main(["status", str(tmp_path)]) == 1
    assert "not a run folder" in capsys.readouterr().err


@pytest.mark.io
def test_keygen_writes_keys_that_a_config_accepts(tmp_path):
    from dpwa.wire.curve import load_secret

    proc = dpwa("keygen", "w1", "--dir", tmp_path / "keys")
    assert proc.returncode == 0, proc.stderr
    line = next(text for text in proc.stdout.splitlines() if "public_key:" in text)
    public = line.split('"')[1]
    secret = tmp_path / "keys" / "w1.key_secret"
    assert f"secret_key_file: {secret}" in proc.stdout
    assert load_secret(secret, public).public.decode() == public
    again = dpwa("keygen", "w1", "--dir", tmp_path / "keys")
    assert again.returncode == 1 and "exists" in again.stderr  # never overwrites a key
