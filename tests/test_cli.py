"""The ``layernorm`` command: help, listing, clear errors, invariances, bench, report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from layernorm import cli


def test_help_explains_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("reproduce", "report", "invariances", "bench", "report.md"):
        assert word in text
    with pytest.raises(SystemExit):
        cli.main(["reproduce", "--help"])
    text = capsys.readouterr().out
    for flag in ("--quick", "--demo", "--device", "--out", "--seed", "--resume", "--list", "--set",
                 "--restart-changed"):  # fmt: skip
        assert flag in text


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "reproduce" in capsys.readouterr().out


def test_list(capsys):
    assert cli.main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("invariances", "geometry", "mnist-ff", "convnet"):
        assert name in out
    assert "batch_sizes" in out  # the settings --set can change


def test_unknown_experiment_lists_valid_names(capsys):
    assert cli.main(["reproduce", "mnist-f", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'mnist-f'" in err and "Valid names:" in err and "convnet" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["reproduce", "invariances", "--set", "nope=1"], "no selected experiment has a setting"),
        (["reproduce", "invariances", "--set", "trials"], "KEY=VALUE"),
        (["reproduce", "invariances", "--set", "trials=many"], "expected a value like"),
        (["reproduce", "invariances", "--device", "tpu"], "device must be"),
        (["reproduce", "mnist-ff", "--set", "seeds=0"], "seeds must be positive"),
        (["reproduce", "mnist-ff", "--set", "norms=layer,group"], "non-empty selection"),
        (["report", "--out", "/nonexistent/place"], "no saved results"),
        (["reproduce", "--demo", "convnet"], "--demo runs its own selection"),
    ],
)
def test_bad_arguments_give_clear_errors(capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_argparse_rejects_negative_seed(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["reproduce", "--seed", "-1"])
    assert e.value.code == 2
    assert "non-negative" in capsys.readouterr().err


def test_cuda_requested_without_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cli.main(["reproduce", "invariances", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_invariances_command_prints_table(capsys):
    assert cli.main(["invariances"]) == 0
    out = capsys.readouterr().out
    assert "| **layer norm** |" in out and "✓" in out and "✗" not in out
    assert "table1: holds" in out


def test_reproduce_and_report(tmp_path, capsys):
    argv = ["reproduce", "invariances", "--quick", "--out", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "table1" in out and str(tmp_path / "report.md") in out
    (tmp_path / "report.md").unlink()
    assert cli.main(["report", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.html").exists()


def test_bench_missing_script_message(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_bench_script", lambda: None)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench"])
    assert "bench_norms_cpu.py was not found" in str(e.value)


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "layernorm", "reproduce", "--list"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and "mnist-ff" in r.stdout


def test_bench_help_names_the_command(capsys):
    # the benchmark script's usage line used to read "__main__.py" (or the script's path)
    if cli._bench_script() is None:
        pytest.skip("no source checkout")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: layernorm bench ")


def test_version(capsys):
    import torch

    import layernorm

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    from layernorm.kernels.cpu import targets

    can_run = ", ".join(targets.available())
    assert capsys.readouterr().out.strip() == (
        f"layernorm {layernorm.__version__} (torch {torch.__version__}; "
        f"CPU kernels {targets.selected().name}, CPU can run {can_run})"
    )


def test_demo_runs_its_selection_quick_with_the_users_settings_last(monkeypatch):
    import layernorm.experiments as ex
    from layernorm.experiments.engine.runner import parse_overrides

    seen = {}
    monkeypatch.setattr(ex, "reproduce", lambda names, **kw: seen.update(names=names, **kw))
    assert cli.main(["reproduce", "--demo", "--set", "mnist-ff.seeds=2"]) == 0
    assert seen["names"] == list(ex.DEMO) and seen["quick"] is True
    assert seen["overrides"] == [*ex.DEMO_SETTINGS, "mnist-ff.seeds=2"]
    # every name is registered and every demo setting applies to one of them
    assert parse_overrides(seen["overrides"], seen["names"])["mnist-ff"] == {"seeds": "2"}
    assert parse_overrides(ex.DEMO_SETTINGS, ex.DEMO)["mnist-ff"] == {"seeds": "3"}
