import json
import os
import sys

import pytest
import torch

from mpguide.cli import main
from mpguide.core import device
from mpguide.models import per_module

FACTORIES = """
import sys

import torch
from torch import nn


class Scale(nn.Module):
    def forward(self, x):
        return x * 1e5


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(4, 8)


def overflows():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Scale(), nn.Linear(8, 8)), torch.randn(4, 8)


def raises():
    raise ValueError("the reader's bug")


def exits():
    sys.exit(3)


def not_a_pair():
    return 42


def text_inputs():
    return nn.Linear(2, 2), "hello"


def wrong_shape():
    return nn.Linear(8, 2), torch.randn(4, 3)


def model_exits():
    class Quits(nn.Module):
        def forward(self, x):
            sys.exit(4)

    return Quits(), torch.ones(1)
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader")
    (path / "factories.py").write_text(FACTORIES)
    (path / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    (path / "exits_on_import.py").write_text("import sys\nsys.exit(5)\n")
    return path


@pytest.fixture
def run(mpguide_main):
    """``python -m mpguide model ARGS`` from a folder, in this process (the reader's exit
    status test below runs one as a process)."""
    return lambda folder, *args, command="model": mpguide_main(command, *args, cwd=folder)


def test_text_names_every_module_call_and_the_findings(folder, run):
    proc = run(folder, "factories.py:make")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Sequential module by module, autocast(")
    assert device.LIVE in lines[1]  # the caption wraps to fit 100 columns
    assert [ln.split()[0] for ln in lines[4:8]] == ["(root)", "0", "1", "2"]
    assert "no module returned inf or NaN where the float64 reference is finite" in proc.stdout


def test_a_package_module_spec_and_json(folder, run):
    proc = run(folder, "factories:make", "--format", "json", "--backward", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = {r["module"]: r for r in doc["rows"]}
    assert rows["0"]["out"] == "bf16" and rows["0"]["params"] == "bf16"
    assert rows["0"]["bwd ops"] > 0 and rows["(root)"]["out err"] > 0
    assert "cast to bfloat16" in doc["caption"]


def test_fp16_overflow_is_named(folder, run):
    proc = run(folder, "factories.py:overflows", "--autocast", "float16", "--format", "markdown")
    assert proc.returncode == 0, proc.stderr
    assert "first non-finite output: 1 (Scale)" in proc.stdout
    assert proc.stdout.startswith("**Sequential module by module, autocast(")


def test_limit_says_how_many_more_and_csv_puts_the_notes_on_stderr(folder, run):
    proc = run(folder, "factories.py:make", "--limit", "2", "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("module,type,in,out,params,ops,casts")
    assert len(proc.stdout.splitlines()) == 3
    assert "mpguide: note: ... 2 more module calls not shown (2 of 4)" in proc.stderr
    text = run(folder, "factories.py:make", "--limit", "1")
    assert text.stdout.splitlines()[-1] == "... 3 more module calls not shown (1 of 4)"


@pytest.mark.parametrize("fmt", ["text", "markdown", "json", "csv"])
def test_a_simulated_device_says_so_in_every_format(folder, fmt, run):
    proc = run(folder, "factories.py:make", "--device", "cuda", "--simulate", "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    assert device.SIMULATED in proc.stdout + proc.stderr
    assert "out err" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["factories.py"], "give FILE.py:NAME or package.module:NAME, got 'factories.py'"),
        (["missing.py:make"], "no file 'missing.py'"),
        (["no_such_module_here:make"], "cannot import 'no_such_module_here'"),
        (["factories.py:nope"], "factories.py has no function 'nope'"),
        (["raises_on_import.py:f"], "importing raises_on_import.py raised RuntimeError: no GPU"),
        (["exits_on_import:f"], "importing exits_on_import raised SystemExit(5)"),
        (["factories.py:raises"], "calling factories.py:raises raised ValueError: the reader's"),
        (["factories.py:exits"], "calling factories.py:exits raised SystemExit(3)"),
        (["factories.py:not_a_pair"], "must return (model, inputs), got int"),
        (["factories.py:text_inputs"], "inputs must be a tensor"),
        (
            ["factories.py:wrong_shape"],
            "running the model of factories.py:wrong_shape on its inputs raised RuntimeError",
        ),
        (["factories.py:model_exits"], "on its inputs raised SystemExit(4)"),
        (["factories.py:make", "--autocast", "fp32"], "--autocast: autocast takes"),
        (["factories.py:make", "--dtype", "fp64"], "float64 already"),
        (["factories.py:make", "--autocast", "fp16", "--dtype", "bf16"], "not allowed with"),
        (["factories.py:make", "--limit", "-1"], "--limit must be 0"),
        (["factories.py:make", "--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_refused_input_is_one_line_and_status_2(folder, args, message, capsys, monkeypatch):
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [str(folder), *sys.path])
    assert main(["model", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("mpguide: error: ") and err.count("\n") == 1
    assert message in err


def test_the_readers_exit_status_does_not_end_the_process(folder, mpguide_main):
    proc = mpguide_main("model", "factories.py:exits", cwd=folder)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "mpguide: error: calling factories.py:exits raised SystemExit(3)\n"


# -- a transformers model, under model and graph -----------------------------------------------

QWEN = """
import torch
import transformers

torch.manual_seed(0)
config = transformers.Qwen2Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2,
)
model = transformers.Qwen2ForCausalLM(config)


def make():
    return model, {"input_ids": torch.randint(0, 64, (2, 16)), "use_cache": False}


def logits(ids):
    return model(ids).logits
"""


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf")
    (path / "qwen.py").write_text(QWEN)
    os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by the processes: nothing is downloaded
    return path


@pytest.mark.slow
def test_model_runs_a_transformers_model_live_and_simulated(qwen, run):
    live = json.loads(run(qwen, "qwen.py:make", "--format", "json").stdout)
    rows = {r["module"]: r for r in live["rows"]}
    assert rows["model.layers.0.mlp.down_proj"]["out"] == "bf16"
    assert rows["model.norm"]["out"] == "f32" and rows["(root)"]["out err"] > 0
    sim = run(qwen, "qwen.py:make", "--device", "cuda", "--simulate", "--autocast", "fp16")
    assert sim.returncode == 0, sim.stderr
    assert "        o_proj  " in sim.stdout and device.SIMULATED in sim.stdout  # nested by depth
    sim = run(qwen, "qwen.py:make", "--device", "cuda", "--simulate", "--format", "json")
    assert "model.layers.0.self_attn.o_proj" in {
        r["module"] for r in json.loads(sim.stdout)["rows"]
    }


@pytest.mark.slow
@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_graph_traces_a_transformers_model_on_any_device(qwen, dev, run):
    proc = run(
        qwen, "qwen.py:logits", "--inputs", "i64[2,64]", "--device", dev,
        "--autocast", "bf16", "--format", "json", command="graph",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["device"] == dev and doc["obtained"] == device.SIMULATED
    flow = doc["graphs"]["forward"]["flow"]
    assert any(r["in"] == "f32" and r["out"] == "bf16" and "q_proj" in r["user code"] for r in flow)


@pytest.mark.slow
def test_json_gives_the_findings_fields_and_keeps_its_keys(folder, qwen, run):
    bf16 = json.loads(run(qwen, "qwen.py:make", "--format", "json").stdout)
    fp16 = json.loads(run(qwen, "qwen.py:make", "--autocast", "fp16", "--format", "json").stdout)
    assert bf16["rows"][0].keys() == fp16["rows"][0].keys()  # no key names the dtype
    assert bf16["first_nonfinite"] is None and bf16["simulated"] is False
    doc = json.loads(
        run(folder, "factories.py:overflows", "--autocast", "fp16", "--format", "json").stdout
    )
    bad = doc["first_nonfinite"]
    assert (bad["module"], bad["type"], bad["out err"]) == ("1", "Scale", "inf")
    rows = {r["module"]: r for r in doc["rows"]}
    assert rows["1"]["out err"] == "inf" and rows["1"]["inf"] > 0  # not null, which is unknown


@pytest.mark.slow
@pytest.mark.parametrize("dev", ["mps", "xpu"])
def test_an_op_the_simulation_cannot_run_is_named_in_one_line(qwen, dev, run):
    proc = run(qwen, "qwen.py:make", "--device", dev)
    if proc.returncode == 0:  # a build whose dispatch stubs have this device runs it
        assert device.SIMULATED in proc.stdout
        return
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert (
        f"the simulated {dev} cannot run an op this model calls at sdpa_attention.py:"
        in proc.stderr
    )
    assert "scaled_dot_product_attention" in proc.stderr and "not the model's error" in proc.stderr


@pytest.mark.slow
def test_a_simulated_transformers_model_says_it_takes_another_path(qwen, run):
    live, sim = (
        json.loads(run(qwen, "qwen.py:make", *extra, "--format", "json").stdout)
        for extra in ((), ("--device", "cpu", "--simulate"))
    )
    ops = [{r["module"]: r["ops"] for r in doc["rows"]}["model"] for doc in (live, sim)]
    assert ops[0] < ops[1]  # the explicit mask's ops, in Qwen2Model's own code
    assert per_module.TRANSFORMERS_PATH in sim["notes"]
    assert per_module.TRANSFORMERS_PATH not in live["notes"]


def test_a_report_past_the_memory_available_is_refused_before_it_runs(folder, run, monkeypatch):
    # make(): Linear(8, 16) and Linear(16, 3), 195 parameters: 1560 bytes as float64, and with
    # --dtype bf16 a 390-byte copy; 1 kB available.
    monkeypatch.setenv("MPGUIDE_MEMORY_GB", "1e-6")
    proc = run(folder, "factories.py:make", "--dtype", "bf16")
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert (
        "the report needs about 1.95 kB on cpu before activations (float64 copy 1.56 kB, cast "
        "copy 390 B) and cpu has 1 kB available (MPGUIDE_MEMORY_GB); set MPGUIDE_MEMORY_GB"
    ) in proc.stderr
    monkeypatch.setenv("MPGUIDE_MEMORY_GB", "1e-5")
    assert run(folder, "factories.py:make", "--dtype", "bf16").returncode == 0
    # A simulated run keeps no copy: nothing to check.
    monkeypatch.setenv("MPGUIDE_MEMORY_GB", "1e-6")
    assert run(folder, "factories.py:make", "--device", "cuda", "--simulate").returncode == 0


@pytest.mark.parametrize("given", ["inf", "-1", "0", "nan", "lots"])
def test_a_memory_override_that_is_no_size_names_the_variable(folder, run, monkeypatch, given):
    monkeypatch.setenv("MPGUIDE_MEMORY_GB", given)
    proc = run(folder, "factories.py:make", "--dtype", "bf16")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"mpguide: error: MPGUIDE_MEMORY_GB must be a number of GB above 0, got {given!r}\n"
    )


def test_progress_goes_to_stderr_only_on_a_terminal_or_when_forced(folder, run, monkeypatch):
    quiet = run(folder, "factories.py:make")
    assert quiet.returncode == 0 and quiet.stderr == ""
    monkeypatch.setenv("MPGUIDE_PROGRESS", "1")
    shown = run(folder, "factories.py:make")
    assert shown.stdout == quiet.stdout
    # The first module call to finish is the first Linear; later lines are at most 4 a second.
    first = "mpguide: run under autocast to bfloat16: module call 1 done (0)"
    assert shown.stderr.splitlines()[0] == first


def test_a_growth_from_an_input_error_of_zero_shows_its_floor():
    # bf16 rounds the weight -1.001 to -1: on equal inputs (exact in bf16, so no input error)
    # the output -0.001 x becomes 0, an error as large as the output.
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -1.001]]))
    x = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    report = per_module.report(lin, x.bfloat16().float().repeat(1, 2), dtype=torch.bfloat16)
    (root,) = report.calls
    floor = torch.finfo(torch.bfloat16).eps / 2
    assert root.input_error.max_rel == 0 and report.growth(root) == root.error.max_rel / floor
    assert report.findings()[1] == (
        f"largest growth in error: (root) (Linear), {report.growth(root):.3g} times: max |error| "
        f"/ mean |ref| 0 in (counted as bfloat16's unit roundoff {floor:.3g}, the floor of a "
        f"growth), {root.error.max_rel:.3g} out"
    )
