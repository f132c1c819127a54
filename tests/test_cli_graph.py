import json

import pytest

from mpguide.core import device

FUNCTIONS = """
import torch


def matmul_into_fp32(x, y, bias):
    out = torch.empty(32, 7, 1, 1, dtype=torch.float32, device=x.device)
    return torch.matmul(x, y, out=out) + bias


def scale_and_sin(x):
    return (x.to(torch.bfloat16) * 2).float().sin()


def raises(x):
    raise ValueError("the reader's bug")


def exits(x):
    raise SystemExit(7)


def masks(x, idx):
    ones = x.new_ones(x.shape, dtype=torch.bool)
    picked = ones[idx]
    counts = torch.where(picked, idx, idx * 2)
    return counts, x.masked_fill(picked, 0.0), x > 0


def doubled(x):
    return x * 2
"""
ISSUE = ("--inputs", "bf16[32,7,1,8]", "bf16[32,7,8,1]", "bf16[32,7,1,1]")


@pytest.fixture(scope="module")
def functions(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "functions.py"
    path.write_text(FUNCTIONS)
    return path


def _json(mpguide_main, *args):
    proc = mpguide_main("graph", *args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_inductor_decomposes_the_bmm_on_cpu_and_keeps_it_on_cuda(functions, mpguide_main):
    fn = f"{functions}:matmul_into_fp32"
    cpu = _json(mpguide_main, fn, *ISSUE, "--device", "cpu", "--backend", "inductor")
    cuda = _json(mpguide_main, fn, *ISSUE, "--device", "cuda", "--backend", "inductor")
    cpu_code, cuda_code = cpu["graphs"]["forward"]["code"], cuda["graphs"]["forward"]["code"]
    assert "aten.bmm" not in cpu_code
    assert "mul: f32[224, 8] = aten.mul.Tensor" in cpu_code
    assert "sum_1: f32[224, 1] = aten.sum.dim_IntList" in cpu_code
    assert "bmm: bf16[224, 1, 1] = aten.bmm(view, view_1)" in cuda_code
    flows = {
        d["device"]: [(r["op"], r["in"], r["out"]) for r in d["graphs"]["forward"]["flow"]]
        for d in (cpu, cuda)
    }
    assert ("prims.convert_element_type", "bf16", "f32") in flows["cpu"]
    assert flows["cuda"] == [
        ("aten.copy", "f32 + bf16", "f32"),
        ("aten.add.Tensor", "f32 + bf16", "f32"),
    ]
    assert {cpu["obtained"], cuda["obtained"]} == {device.SIMULATED}
    assert list(cuda["graphs"]) == ["forward"]


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_every_format_says_the_graph_was_simulated(functions, fmt, mpguide_main):
    args = (f"{functions}:scale_and_sin", "--inputs", "f32[8]", "--backward", "--format", fmt)
    proc = mpguide_main("graph", *args)
    assert proc.returncode == 0, proc.stderr
    assert device.SIMULATED in proc.stdout
    assert proc.stdout.count("backward") >= 2 and "aten.cos" in proc.stdout


def test_autocast_puts_its_casts_in_the_graph(functions, mpguide_main):
    doc = _json(
        mpguide_main,
        f"{functions}:scale_and_sin",
        "--inputs",
        "f32[8]",
        "--device",
        "cuda",
        "--autocast",
        "fp16",
    )
    assert doc["device"] == "cuda" and "forward" in doc["graphs"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py:f", "--inputs", "f32[2]"], "no file 'missing.py'"),
        (["{f}:nope", "--inputs", "f32[2]"], "has no function 'nope'"),
        (["{f}", "--inputs", "f32[2]"], "give FILE.py:NAME or package.module:NAME"),
        (["{f}:exits", "--inputs", "f32[2]"], "SystemExit(7)"),
        (["no_such_module_here:f", "--inputs", "f32[2]"], "cannot import 'no_such_module_here'"),
        (["{f}:scale_and_sin", "--inputs", "f32(2)"], "bad input 'f32(2)'"),
        (["{f}:scale_and_sin", "--inputs", "f32[2]", "--device", "tpu"], "unknown device 'tpu'"),
        (
            ["{f}:scale_and_sin", "--inputs", "f32[2]", "--backend", "eager"],
            "invalid choice: 'eager'",
        ),
        (["{f}:scale_and_sin", "--inputs", "f32[2]", "--autocast", "float32"], "--autocast takes"),
        (["{f}:raises", "--inputs", "f32[2]"], "raised ValueError: the reader's bug"),
        (["{f}:scale_and_sin"], "required: --inputs"),
    ],
)
def test_refused_input_is_one_line_and_status_2(functions, args, message, mpguide_main):
    proc = mpguide_main("graph", *(a.replace("{f}", str(functions)) for a in args))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("mpguide: error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr


def test_a_package_module_spec_names_the_same_function(functions, mpguide_main):
    proc = mpguide_main(
        "graph", "functions:scale_and_sin", "--inputs", "f32[8]", cwd=functions.parent
    )
    assert proc.returncode == 0, proc.stderr
    assert "aten.sin" in proc.stdout


@pytest.mark.skipif(device.simulates_autograd("cuda"), reason="autograd runs on CUDA here")
def test_backward_on_a_device_this_build_cannot_differentiate_is_refused(functions, mpguide_main):
    proc = mpguide_main(
        "graph",
        f"{functions}:scale_and_sin",
        "--inputs",
        "f32[8]",
        "--device",
        "cuda",
        "--backward",
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "no backward graph" in proc.stderr
    assert "cannot run autograd on a simulated cuda" in proc.stderr


def _line(code: str) -> str:
    """``functions.py:N``, N the line of FUNCTIONS that holds ``code``."""
    (n,) = [i for i, text in enumerate(FUNCTIONS.splitlines(), 1) if code in text]
    return f"functions.py:{n}"


def test_masks_indices_and_new_tensors_are_named_for_what_they_are(functions, mpguide_main):
    doc = _json(mpguide_main, f"{functions}:masks", "--inputs", "f32[8]", "i64[8]")
    flow = doc["graphs"]["forward"]["flow"]
    # index picks bools with integer indices; where and masked_fill choose with a mask
    assert [(r["op"], r["change"], r["in"], r["out"]) for r in flow] == [
        ("aten.new_ones", "new tensor", "f32", "b8"),
        ("aten.gt.Scalar", "comparison", "f32", "b8"),
    ]
    assert [r["line"] for r in flow] == [_line("x.new_ones"), _line("x > 0")]


@pytest.mark.parametrize("columns", [60, 80, 100])
def test_the_user_line_survives_a_narrow_terminal(functions, mpguide_main, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    proc = mpguide_main("graph", f"{functions}:masks", "--inputs", "f32[8]", "i64[8]")
    assert proc.returncode == 0, proc.stderr
    after = proc.stdout.split("dtype changes in the forward graph")[1]
    if columns < 80:  # too narrow for it: the column is left out, and a note says so
        assert "columns left out to fit 60 characters: line, user code" in after
    else:  # the code is cut, never the file:line
        assert sum(_line("x.new_ones") in r for r in after.splitlines()) == 1
    assert max(map(len, proc.stdout.splitlines())) <= columns


def test_a_graph_without_dtype_changes_says_so_in_one_wrapped_line(
    functions, mpguide_main, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "60")
    proc = mpguide_main("graph", f"{functions}:doubled", "--inputs", "f32[8]", "--device", "cuda")
    said = proc.stdout.split("\n\n")[-1].rstrip()
    assert " ".join(said.split()) == (
        "no node of the forward graph changes the dtype (aot_eager, cuda (simulated))"
    )
    assert max(map(len, said.splitlines())) <= 60
