import json
import sys

import pytest
import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.models import lowbit_report

FACTORIES = """
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    with torch.no_grad():
        model[2].weight[:, 5] *= 100  # one input channel of the last layer far larger
    return model, torch.randn(4, 64)


def convs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3), nn.Flatten(2), nn.Linear(64, 64), nn.Embedding(4, 4))
    return model[:3], torch.randn(2, 3, 10, 10)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 4)

    def forward(self, x):
        return self.lin(input=x)


def keywords():
    return Keywords(), torch.randn(2, 32)


def frozen():
    model = nn.Linear(32, 4).requires_grad_(False)
    return model, torch.randn(2, 32)


def gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=1, n_head=4, bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(config)
    return model, {"input_ids": torch.randint(0, 64, (2, 16)), "use_cache": False}


def hf():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    return model, {"input_ids": torch.randint(0, 64, (2, 16)), "use_cache": False}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("lowbit")
    (path / "factories.py").write_text(FACTORIES)
    return path


@pytest.fixture
def run(mpguide_main):
    return lambda folder, *args: mpguide_main("model", *args, cwd=folder)


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return model, torch.randn(8, 32)


def test_report_measures_every_linear_layer_against_float64():
    model, x = _mlp()
    report = lowbit_report.report(model, x, "mxfp4", backward=True)
    assert [r.module for r in report.rows] == ["0", "2"]
    first = report.rows[0]
    ref = x.double()
    assert first.input.rel_error == pytest.approx(
        ((first.input.values.double() - ref).norm() / ref.norm()).item()
    )
    assert all(0 < r.output_error < 0.5 and r.grad_error > 0 for r in report.rows)
    assert report.keep_first[0] == max(report.rows, key=lambda r: r.output_error).module
    assert not any(p.grad is not None for p in model.parameters())


def test_plain_casts_count_values_past_the_max():
    model, x = _mlp()
    report = lowbit_report.report(model, x * 1000, "float8_e4m3fn")
    assert report.rows[0].input.overflow > 0 and report.rows[0].input.saturated == 0
    table = report.table()
    assert "inf/NaN" in table.notes[0] and table.column("in max %")[0] > 0


def test_bad_block_size_names_the_module():
    model, x = _mlp()
    with pytest.raises(MPGuideError, match=r"^0: block size 128 does not divide the last dim"):
        lowbit_report.report(model, x, "blockwise_1x128")


def test_cli_names_the_layer_to_keep(folder, run):
    proc = run(folder, "factories.py:make", "--target", "nvfp4", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout)
    errors = {r["module"]: r["out err"] for r in table["rows"]}
    assert errors["2"] > errors["0"]
    assert table["notes"][1] == "keep in higher precision first: 2, 0"


def test_cli_csv_puts_the_notes_on_stderr(folder, run):
    proc = run(folder, "factories.py:make", "--target", "tensorwise", "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("module,")
    assert "mpguide: note: keep in higher precision first: " in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--target", "fp5"), "unknown target 'fp5'"),
        (("--target", "mxfp8", "--dtype", "bf16"), "no --dtype"),
        (("--target", "blockwise_128x128"), "0: block size 128 does not divide"),
        (("--target", "mxfp8", "--columns", "module"), "--target has its own"),
    ],
)
def test_cli_bad_input_is_one_line(folder, run, args, message):
    proc = run(folder, "factories.py:make", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("mpguide: error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_cli_on_a_transformers_model_built_from_its_config(folder, run, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = run(folder, "factories.py:hf", "--target", "mxfp8", "--backward")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("linear layers under mxfp8 (8.25 bits per weight)")
    assert any(line.startswith("model.layers.0.mlp.down_proj") for line in lines)
    assert any(line.startswith("lm_head") for line in lines)
    assert "keep in higher precision first: " in proc.stdout


def test_a_layer_called_with_keywords_is_measured(folder, run):
    proc = run(folder, "factories.py:keywords", "--target", "mxfp8", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert [r["module"] for r in json.loads(proc.stdout)["rows"]] == ["lin"]


def test_backward_on_an_output_without_grad_says_so(folder, run):
    proc = run(folder, "factories.py:frozen", "--target", "mxfp8", "--backward")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "mpguide: error: --backward: no output of the model requires grad (are its parameters "
        "frozen, or its outputs detached?)\n"
    )


def test_convolutions_are_named_as_left_out(folder, run):
    proc = run(folder, "factories.py:convs", "--target", "mxfp8", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout)
    assert [r["module"] for r in table["rows"]] == ["2"]
    assert table["notes"][-1].startswith("left out: 1 Conv2d (quantized: torch.nn.Linear and ")
    with pytest.raises(MPGuideError, match=r"ran no linear layer .*; left out: 1 Conv2d$"):
        lowbit_report.capture(nn.Conv2d(3, 4, 3), torch.randn(1, 3, 4, 4))


@pytest.mark.parametrize("columns", [60, 80])
def test_the_text_report_fits_columns(folder, run, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    proc = run(folder, "factories.py:make", "--target", "nvfp4")
    assert proc.returncode == 0, proc.stderr
    assert max(map(len, proc.stdout.splitlines())) <= columns
    assert "keep in higher precision first: 2, 0" in " ".join(proc.stdout.split())


@pytest.mark.slow  # builds a transformers model
def test_gpt2_conv1d_layers_are_measured_as_linear_layers(folder, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "factories", raising=False)  # another test's, same name
    import factories

    model, inputs = factories.gpt2()
    captured = lowbit_report.capture(model, inputs)
    modules = dict(model.named_modules())
    conv1d = [n for n, m in modules.items() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 4
    assert [c.name for c in captured] == [*conv1d, "lm_head"]
    for c in captured[:4]:  # the (in, out) weight turned into a Linear's (out, in)
        out = torch.nn.functional.linear(c.input, c.weight, c.bias)
        torch.testing.assert_close(out, modules[c.name](c.input))
    report = lowbit_report.report(model, inputs, "mxfp8")
    assert report.left_out == (("Embedding", 2),)
