"""The modules behind the questions pages 12-14: float32 emulation schemes, inductor code
facts, CPU flags, the conv decoder, op-family dtypes."""

import pytest
import torch

from mpguide import MPGuideError
from mpguide.compiled import generated_code
from mpguide.core import cpu_bf16, dtypes
from mpguide.models import conv_decoder
from mpguide.precision import split_matmul
from mpguide.training.op_dtypes import compute_dtypes


def test_three_bf16_terms_hold_a_float32_value():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    terms = split_matmul.split(x, "bfloat16", 3)
    assert all(torch.equal(t, t.bfloat16().float()) for t in terms)
    assert torch.equal(terms[0] + terms[1] + terms[2], x)
    assert not torch.equal(terms[0], x)


def test_schemes_count_their_products_and_order_by_error():
    assert [split_matmul.products(s) for s in ("bf16", "bf16x3", "bf16x6", "bf16x9", "tf32x3")] == [
        1,
        3,
        6,
        9,
        3,
    ]
    found = split_matmul.scheme_errors((16, 256, 16))
    assert found.errors["bf16x9"] < found.errors["bf16x3"] < found.errors["bf16"]
    with pytest.raises(MPGuideError, match="unknown scheme"):
        split_matmul.emulated(torch.ones(2, 2), torch.ones(2, 2), "bf16x4")


def test_accepted_names_the_refusal_and_restores_the_switch():
    before = torch.backends.cuda.matmul.fp32_precision
    got = split_matmul.accepted("cuda.matmul", ("ieee", "no-such-precision"))
    assert got["ieee"] == "accepted" and got["no-such-precision"].startswith("RuntimeError")
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_facts_read_calls_kernels_accumulators_and_dot_precision():
    code = (
        "cpp_fused_sum_0 = async_compile.cpp_pybinding(['const at::BFloat16*'], r'''\n"
        "    float tmp_acc0 = 0;\n'''\n"
        "triton_mm_1 = async_compile.triton('x', '''\n"
        "    acc = tl.dot(a, b, input_precision=\"tf32\")\n'''\n"
        "buf0 = extern_kernels.mm(arg0_1, arg1_1)\n"
    )
    found = generated_code.facts(code)
    assert found.extern == ("extern_kernels.mm",)
    assert found.kernels == ("cpp_fused_sum_0", "triton_mm_1")
    assert found.accumulators == ("float",)
    assert found.dot_precision == ("input_precision=tf32",)


def test_cpu_flags_read_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor: 0\nflags\t\t: fpu avx2 avx512f amx_bf16\n")
    assert cpu_bf16.cpu_flags(info) == {
        "avx512f": True,
        "avx512_bf16": False,
        "amx_tile": False,
        "amx_bf16": True,
        "avx2": True,
    }
    assert cpu_bf16.cpu_flags(tmp_path / "missing") is None


def test_rescaled_decoder_gives_the_same_image_and_fits_float16():
    dec = conv_decoder.build()
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    plain = conv_decoder.decode(dec, z, torch.float32)
    small = conv_decoder.decode(conv_decoder.rescaled(dec, 8), z, torch.float32)
    assert torch.allclose(plain.image, small.image, rtol=1e-3, atol=1e-3)
    assert conv_decoder.decode(dec, z, torch.float16).first_nonfinite is not None
    assert conv_decoder.decode(conv_decoder.rescaled(dec, 8), z, torch.float16).nan_share == 0
    with pytest.raises(MPGuideError, match="positive"):
        conv_decoder.rescaled(dec, 0)


def test_compute_dtypes_reads_outputs_per_family():
    x = torch.randn(4, 8).bfloat16()
    with dtypes.Log() as log:
        torch.softmax(x, -1)
        torch.log_softmax(x, -1, dtype=torch.float32)
        x @ x.T
    assert compute_dtypes(log) == {
        "softmax": "bfloat16",
        "log_softmax (cross-entropy)": "float32",
        "matmul": "bfloat16",
    }


def test_every_section_of_pages_12_to_14_answers_a_question():
    from helpers import ROOT

    from mpguide import questions

    answered = {q.answered_by for q in questions.load() if q.answered_by}
    pages = sorted((ROOT / "examples" / "questions").glob("plot_1[2-4]_*.py"))
    assert len(pages) == 3
    for page in pages:
        rel = page.relative_to(ROOT).as_posix()
        for anchor in questions.sections(page):
            if anchor not in ("setup", "what-we-saw"):
                assert f"{rel}#{anchor}" in answered, f"{rel}#{anchor} answers no question"


def test_lora_layer_casts_input_to_adapter_and_back():
    from mpguide.training import lora_precision

    layer = lora_precision.adapter(torch.float32, width=16, rank=4)
    x = torch.randn(2, 16).bfloat16()
    with torch.no_grad():
        layer.lora_B.weight.fill_(0.1)
        out = layer(x)
        expected = layer.base(x).float() + layer.scaling * layer.lora_B(layer.lora_A(x.float()))
    assert out.dtype == torch.bfloat16 and layer.lora_A.weight.dtype == torch.float32
    assert torch.equal(out, expected.bfloat16())


def test_bf16_adapter_loses_small_updates():
    from mpguide.training import lora_precision

    kept = lora_precision.kept_update(steps=3, lr=1e-4, width=32)
    assert kept.unchanged_first_step["float32"] == 0.0 < kept.unchanged_first_step["bfloat16"]
    with pytest.raises(MPGuideError, match="steps"):
        lora_precision.kept_update(steps=0)


def test_fake_quant_patches_linears_for_the_block_only():
    from torch import nn

    from mpguide.models import fake_quant

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    ref = model(x)
    with (
        torch.no_grad(),
        fake_quant.quantized(model, "nvfp4", activations=True, skip=("2",)) as err,
    ):
        got = model(x)
    assert set(err) == {"0"} and 0 < err["0"] < 0.5
    assert not torch.equal(got, ref) and torch.equal(model(x), ref)
    with (
        pytest.raises(MPGuideError, match="unknown recipe"),
        fake_quant.quantized(model, "int3", activations=False),
    ):
        pass
