import csv
import functools
import io
import json

import pytest
import torch

from mpguide.autocast import policy
from mpguide.cli import main
from mpguide.core import device


@pytest.fixture(autouse=True, scope="module")
def probe_each_policy_once():
    """The formats render the same probes: each device, dtype and mode is probed once here
    (test_policy checks the probing)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(policy, "probe", functools.cache(policy.probe))
    yield
    patch.undo()


@pytest.mark.slow
def test_policy_json_matches_the_catalogue(capsys):
    assert main(["policy", "--device", "cpu", "--dtype", "bf16", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == len(policy.registered())
    matmul = next(r for r in data["rows"] if r["op"] == "matmul")
    assert matmul["class"] == "lower precision"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "markdown", "csv"])
def test_policy_formats(capsys, fmt):
    assert main(["policy", "--device", "cpu", "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "matmul" in out and "lower precision" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["policy", "--device", "tpu"],
            "unknown device 'tpu'; this build's autocast knows cpu, cuda",
        ),
        (["policy", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["policy", "--dtype", "float32"], "bfloat16 or float16"),
        (["policy", "--format", "xml"], "invalid choice: 'xml'"),
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_give_one_line_and_status_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mpguide: error: ") and message in captured.err


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_simulated(mpguide_main):
    proc = mpguide_main("policy", "--device", "cuda", "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert {r["obtained"] for r in rows} == {device.SIMULATED}
    by_op = {r["op"]: r for r in rows}
    assert by_op["softmax"]["class"] == "float32"
    assert by_op["mv"]["class"] == "lower precision"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "markdown", "json", "csv"])
def test_every_format_says_how_the_policy_was_obtained(capsys, fmt):
    assert main(["policy", "--device", "cpu", "--format", fmt]) == 0
    live = " ".join(capsys.readouterr().out.split())  # text wraps the caption
    assert device.LIVE in live and device.SIMULATED not in live
    assert main(["policy", "--device", "cpu", "--simulate", "--format", fmt]) == 0
    assert device.SIMULATED in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_all_devices_in_one_table_with_the_differences(mpguide_main, monkeypatch):
    # 'all' is one column per type device.simulated_types() gives; two keep the test short.
    monkeypatch.setattr(device, "simulated_types", lambda: ("cpu", "cuda"))
    proc = mpguide_main("policy", "--device", "all", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [c.split(" (")[0] for c in list(data["rows"][0])[2:-1]] == ["cpu", "cuda"]
    row = next(r for r in data["rows"] if r["op"] == "sum")
    cpu_col = next(k for k in row if k.startswith("cpu ("))
    cuda_col = next(k for k in row if k.startswith("cuda ("))
    assert (row[cpu_col], row[cuda_col], row["differs"]) == ("unchanged", "float32", "yes")
    matmul = next(r for r in data["rows"] if r["op"] == "matmul")
    assert matmul["differs"] == ""
    assert ": " in data["notes"][0] and "sum" in data["notes"][0].split(": ")[1].split(", ")


def test_version(capsys):
    import mpguide

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"mpguide {mpguide.__version__}\n"


def test_every_option_has_help():
    from mpguide.cli import parser

    sub = next(a for a in parser()._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
