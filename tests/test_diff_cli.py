import inspect
import json

import pytest
import test_diff_target

FACTORIES = """
import torch
from torch import nn


class Rounds(nn.Module):
    def forward(self, x):
        return x.to(torch.float8_e4m3fn).to(x.dtype)


class Elementwise(nn.Module):
    # Autocast leaves elementwise ops in float32: the planted rounding is the only one.
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 16))
        self.planted = Rounds()

    def forward(self, x):
        h = torch.tanh(x * self.scale)
        return torch.exp(self.planted(h) + 1.0)


def make():
    torch.manual_seed(0)
    return Elementwise(), torch.randn(4, 16)


@torch.library.custom_op("mpguide_cli_test::single_only", mutates_args=())
def single_only(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        raise NotImplementedError("not implemented for 'Double'")
    return x * 2


class Single(nn.Module):
    def forward(self, x):
        return single_only(x) + 1


def single():
    return Single(), torch.randn(4)


from test_diff_target import layers  # the planted weight between fp4 grid points
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader")
    (path / "diff_factories.py").write_text(FACTORIES)
    return path


@pytest.fixture
def run(mpguide_main, folder):
    return lambda *args: mpguide_main("diff", *args, cwd=folder)


def test_text_ranks_the_planted_source_first_and_fits(run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    proc = run("diff_factories.py:make", "--backward", "--fix", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines)
    rows = [line.split() for line in lines if line[:1].isdigit()]
    assert next(r for r in rows if r[1] == "fwd")[2] == "planted"
    text = " ".join(proc.stdout.split())  # notes wrapped to the width, unwrapped
    assert "largest source: planted at diff_factories.py:8 (_to_copy×2)" in text
    assert "fix list: Elementwise, autocast to bfloat16" in text
    assert "keep planted (diff_factories.py:8)" in text


def test_json_holds_the_ranking_and_the_fix_list(run):
    proc = run("diff_factories.py:make", "--fix", "1", "--by", "ops", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["rows"][0]["module"] == "planted" and doc["rows"][0]["op"] == "_to_copy"
    assert doc["fix_list"]["rows"][0]["keep in float32"] == "planted"
    assert float(doc["fix_list"]["rows"][0]["drop"].rstrip(" %")) > 99


@pytest.mark.parametrize("view", ["modules", "grads"])
def test_csv_and_markdown_put_every_view(run, view):
    csv = run("diff_factories.py:make", "--backward", "--by", view, "--format", "csv")
    assert csv.returncode == 0, csv.stderr
    assert csv.stderr.startswith(f"mpguide: note: {view}: Elementwise op by op")
    md = run("diff_factories.py:make", "--backward", "--by", view, "--format", "markdown")
    assert md.stdout.startswith("|") or md.stdout.startswith(f"**{view}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "int8"], "--dtype: "),
        (["--fix", "-1"], "--fix must be 0 or more"),
        (["--by", "grads"], "--by grads needs --backward"),
        (["--limit", "-2"], "--limit must be"),
        (["--device", "meta"], "unknown device 'meta'"),
        (["--target", "nvfp9"], "unknown target 'nvfp9'; choose one of tensorwise"),
        (["--target", "nvfp4", "--pure"], "--target runs the model in its own dtype"),
        (["--target", "nvfp4", "--dtype", "float16"], "no --dtype or --pure"),
        (["--target", "nvfp4", "--backward"], "--backward: a low-bit target has no backward"),
    ],
)
def test_refused_input_is_one_line_and_status_2(run, args, message):
    proc = run("diff_factories.py:make", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("mpguide: error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr


@pytest.mark.parametrize("target", ["nvfp4", "mxfp4"])
def test_a_target_ranks_the_planted_layer_first_with_its_fix(run, monkeypatch, target):
    monkeypatch.setenv("COLUMNS", "100")
    proc = run("diff_factories.py:layers", "--target", target, "--fix", "1")
    assert proc.returncode == 0, proc.stderr
    assert all(len(line) <= 100 for line in proc.stdout.splitlines())
    text = " ".join(proc.stdout.split())
    assert f"Layers op by op, linear layers quantized to {target}, against a float64" in text
    source, first = inspect.getsourcelines(test_diff_target.Layers.forward)
    line = first + next(i for i, s in enumerate(source) if "self.b(" in s)
    where = f"test_diff_target.py:{line}"
    assert f"largest source: b at {where} (quantize {target}×2, addmm)" in text
    assert f"fix list: Layers, linear layers quantized to {target}" in text
    assert f"keep b ({where})" in text
    proc = run("diff_factories.py:layers", "--target", target, "--by", "ops", "--format", "json")
    rows = json.loads(proc.stdout)["rows"]
    assert rows[0]["op"] == f"quantize {target} (weight)" and rows[0]["module"] == "b"


def test_an_op_without_a_float64_kernel_is_named_and_float32_runs(run):
    proc = run("diff_factories.py:single")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "mpguide_cli_test.single_only has no float64 kernel on cpu" in proc.stderr
    assert "--reference float32" in proc.stderr
    proc = run("diff_factories.py:single", "--reference", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "against a float32 shadow" in proc.stdout


def test_progress_on_stderr_when_forced(run, monkeypatch):
    monkeypatch.setenv("MPGUIDE_PROGRESS", "1")
    proc = run("diff_factories.py:make")
    assert proc.returncode == 0
    assert "mpguide: run under autocast to bfloat16: module call 1" in proc.stderr


def test_the_parser_names_the_views_diff_has_without_importing_it():
    from mpguide import cli_diff
    from mpguide.models import diff

    assert cli_diff.VIEWS == diff.VIEWS
