"""Every command's default text output fits a terminal of 100 columns, on real models
(transformers, built from configs) and real GPU traces (tests/data/gpu)."""

import os
from pathlib import Path

import pytest

from mpguide.core import terminal

# Slow: transformers models and every device's policy (-m 'not slow' leaves it out).
pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data"
GPU_TRACES = sorted((DATA / "gpu").glob("*.json.gz"))
WIDTH = 100

MODELS = """
import torch
import transformers

torch.manual_seed(0)
qwen = transformers.Qwen2ForCausalLM(
    transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
)
bert = transformers.BertForSequenceClassification(
    transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, num_labels=3,
    )
)


def make_qwen():
    return qwen, {"input_ids": torch.randint(0, 64, (2, 16)), "use_cache": False}


def make_bert():
    ids = torch.randint(0, 64, (2, 16))
    return bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(ids):
    return qwen(ids).logits


def doubled(x):
    return x * 2


def clipped(x):
    return torch.where(x >= 0, x, 0.0)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("fit")
    (path / "models.py").write_text(MODELS)
    os.environ["HF_HUB_OFFLINE"] = "1"
    return path


def _fits(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    wide = [line for line in proc.stdout.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} lines wider than {WIDTH}, the first: {wide[0]!r}"


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def test_the_width_comes_from_columns_else_the_terminal_else_100(monkeypatch):
    assert terminal.width() == WIDTH
    monkeypatch.setenv("COLUMNS", "0")
    assert terminal.width() == terminal.DEFAULT  # stdout is no terminal under pytest


def test_names_are_shortened_from_the_middle():
    name = "model.layers.0.self_attn.q_proj"
    short = terminal.abbreviate(name, 20)
    assert len(short) == 20 and short.startswith("model") and short.endswith("q_proj")
    assert terminal.abbreviate("    " + name, 24).startswith("    model")


@pytest.mark.parametrize(
    "args",
    [
        ("policy",),
        ("policy", "--device", "all"),
        ("formats",),
        ("tree", DATA / "ranks"),
        ("casts", DATA / "ranks"),
    ],
    ids=["policy", "policy-all", "formats", "tree-ranks", "casts-ranks"],
)
def test_tables_of_this_build_fit(args, mpguide_main):
    _fits(mpguide_main(*args))


@pytest.mark.parametrize("trace", GPU_TRACES, ids=[t.name.split(".json")[0] for t in GPU_TRACES])
def test_casts_of_real_gpu_traces_fit(trace, mpguide_main):
    _fits(mpguide_main("casts", trace))


@pytest.mark.parametrize("by", ["cast", "pair", "module", "fused"])
def test_every_view_of_casts_fits(by, mpguide_main):
    _fits(
        mpguide_main("casts", DATA / "gpu" / "b200_vllm_gpt-oss_eager_window.json.gz", "--by", by)
    )


@pytest.mark.parametrize(
    "args",
    [
        ("model", "models.py:make_qwen"),
        ("model", "models.py:make_bert", "--backward"),
        ("model", "models.py:make_qwen", "--device", "cuda", "--simulate"),
        ("inference", "--model", "models.py:make_bert", "--repeat", "2", "--warmup", "0"),
        ("graph", "models.py:logits", "--inputs", "i64[2,16]"),
    ],
    ids=["model-qwen", "model-bert-backward", "model-simulated", "inference-bert", "graph-qwen"],
)
def test_commands_on_real_models_fit(args, models, mpguide_main):
    _fits(mpguide_main(*args, cwd=models))


def test_model_shows_the_columns_that_matter_and_the_rest_on_request(models, mpguide_main):
    shown = mpguide_main("model", "models.py:make_qwen", cwd=models).stdout.splitlines()
    assert shown[2].split() == [
        *("module", "in", "out", "casts", "out", "err", "inf", "nan", "to", "zero", "type"),
    ]
    nested = [line.split()[0] for line in shown[4:8]]
    assert nested == ["(root)", "model", "embed_tokens", "rotary_emb"]


def test_model_at_80_columns_keeps_whole_module_names(models, mpguide_main, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    shown = mpguide_main("model", "models.py:make_qwen", cwd=models).stdout.splitlines()
    assert shown[2].split()[:2] == ["module", "in"] and "type" not in shown[2].split()
    names = [line.split()[0] for line in shown[4:] if line.startswith(" ")]
    assert {"input_layernorm", "gate_proj", "down_proj"} <= set(names)
    assert all(len(n) >= 16 for n in names if "..." in n)  # cut, never to a stub
    assert "left out to fit 80 characters: type" in " ".join(" ".join(shown).split())
    every = mpguide_main("model", "models.py:make_qwen", "--columns", "all", cwd=models)
    assert "autocast casts" in every.stdout or "left out to fit" in every.stdout
    bad = mpguide_main("model", "models.py:make_qwen", "--columns", "speed", cwd=models)
    assert bad.returncode == 2 and "no column 'speed'" in bad.stderr


def test_graph_shows_what_was_asked_and_names_each_change(models, mpguide_main):
    """The Qwen2 parameters require grad, yet without --backward no backward graph is shown;
    the embedding's integer indices are no dtype change; a comparison is not a promotion."""
    import json

    proc = mpguide_main("graph", "models.py:logits", "--inputs", "i64[2,16]", cwd=models)
    assert "# aot_eager, forward" in proc.stdout and "backward" not in proc.stdout
    doc = json.loads(
        mpguide_main(
            "graph", "models.py:logits", "--inputs", "i64[2,16]", "--format", "json", cwd=models
        ).stdout
    )
    assert list(doc["graphs"]) == ["forward"]
    flow = doc["graphs"]["forward"]["flow"]
    # transformers builds Qwen2's mask another way on some torch releases (a comparison on
    # 2.11): comparisons are labelled as such, and the one conversion is the only other row.
    compared = [r for r in flow if r["op"].split(".")[1] in {"le", "lt", "ge", "gt", "eq", "ne"}]
    assert all(r["change"] == "comparison" for r in compared)
    rest = [(r["op"], r["change"]) for r in flow if r not in compared]
    assert rest == [("aten._to_copy", "conversion")]
    both = mpguide_main(
        "graph", "models.py:logits", "--inputs", "i64[2,16]", "--backward", cwd=models
    )
    assert "# aot_eager, backward" in both.stdout
    backward = both.stdout.split("# aot_eager, backward")[1].rstrip().split("\n\n")[-1]
    assert "embedding_dense_backward" not in backward
    assert " ".join(backward.split()).startswith("no node of the backward graph changes the dtype")
    ge = json.loads(
        mpguide_main(
            "graph", "models.py:clipped", "--inputs", "f32[8]", "--format", "json", cwd=models
        ).stdout
    )["graphs"]["forward"]["flow"]
    assert [(r["op"], r["change"], r["out"]) for r in ge] == [
        ("aten.ge.Scalar", "comparison", "b8")
    ]
    same = mpguide_main("graph", "models.py:doubled", "--inputs", "f32[8]", cwd=models)
    last = same.stdout.rstrip().splitlines()[-1]
    assert last.startswith("no node of the forward graph changes the dtype (aot_eager, cpu")
