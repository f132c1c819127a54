import json
import re
from pathlib import Path

import pytest
import torch

from mpguide import MPGuideError, record
from mpguide.cli import main
from mpguide.table import Table

CPU = torch.device("cpu")


@pytest.fixture
def tiny(monkeypatch):
    table = Table(("op", "dtype"), (("mm", torch.bfloat16),), "caption")
    monkeypatch.setattr(record, "MEASUREMENTS", {"t.one": lambda dev: table})
    return table


def test_a_recording_round_trips_with_its_provenance(tmp_path, tiny):
    rec = record.measure(CPU, "python -m mpguide record --allow-cpu")
    path = record.save(rec, tmp_path / "cpu.json")
    back = record.load(path)
    assert back.provenance == rec.provenance
    assert back.provenance.torch == torch.__version__
    assert back.provenance.command == "python -m mpguide record --allow-cpu"
    assert back.tables["t.one"].rows == (("mm", "bfloat16"),)
    assert back.tables["t.one"].caption == "caption"


def test_the_schema_has_every_provenance_field(tmp_path, tiny):
    doc = json.loads(record.measure(CPU, "cmd").to_json())
    assert doc["schema"] == record.SCHEMA
    assert set(doc["provenance"]) == {
        "device",
        "name",
        "driver",
        "cuda",
        "torch",
        "date",
        "command",
    }
    assert doc["results"]["t.one"]["columns"] == ["op", "dtype"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"schema": 99}', "not an mpguide recording"),
        ('{"schema": 1, "provenance": {}, "results": {}}', "malformed recording"),
    ],
)
def test_bad_files_are_named(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(MPGuideError, match=message):
        record.load(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(MPGuideError, match="no such file"):
        record.load(tmp_path / "none.json")


def test_unknown_keys_are_refused(tiny):
    with pytest.raises(MPGuideError, match="unknown measurement 'nope'"):
        record.measure(CPU, "cmd", ["nope"])


def test_beside_shows_live_and_recorded_with_labels(tmp_path, tiny):
    gpu = record.Provenance(
        "cuda", "NVIDIA H200", "570.1", "12.8", "2.13.0", "2026-11-21", "python -m mpguide record"
    )
    record.save(record.Recording(gpu, {"t.one": tiny}), tmp_path / "h200.json")
    live = Table(("op", "dtype"), (("mm", "float32"),))
    shown = record.beside("t.one", live, directory=tmp_path)
    html = shown._repr_html_()
    assert "measured live" in html and "recorded on NVIDIA H200 (cuda)" in html
    assert "driver 570.1" in html and "CUDA 12.8" in html
    assert html.index("measured live") < html.index("recorded on")
    assert "bfloat16" in repr(shown) and "float32" in repr(shown)
    assert record.beside("t.other", None, directory=tmp_path).recorded == ()


def test_the_cli_refuses_a_cpu_without_the_flag(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["record", "--out", str(tmp_path / "x.json")]) == 2
    assert "--allow-cpu" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_cli_records_a_cpu_on_request(capsys, tmp_path, tiny):
    out = tmp_path / "cpu.json"
    assert main(["record", "--allow-cpu", "--device", "cpu", "--out", str(out)]) == 0
    assert "[1/1] t.one" in capsys.readouterr().err
    assert record.load(out).provenance.command.startswith("python -m mpguide record")


def test_recordings_are_found_through_the_environment(tmp_path, monkeypatch, tiny):
    rec = record.measure(CPU, "cmd")
    record.save(rec, tmp_path / "gpu.json")
    monkeypatch.setenv("MPGUIDE_RECORDED", str(tmp_path))
    assert [r.provenance for r in record.recordings()] == [rec.provenance]
    assert record.beside("t.one").recorded[0][1].rows == (("mm", "bfloat16"),)


def test_every_key_a_page_shows_is_measured():
    root = Path(__file__).resolve().parents[1] / "examples"
    shown = set()
    for path in root.rglob("plot_*.py"):
        shown |= set(re.findall(r'record\.beside\(\s*"([^"]+)"', path.read_text()))
    assert shown, "no page shows a recording"
    assert shown <= set(record.MEASUREMENTS)


def test_every_measurement_runs_on_the_cpu():
    rec = record.measure(CPU, "cmd")
    assert set(rec.tables) == set(record.MEASUREMENTS)
    assert all(t.rows for t in rec.tables.values())
    back = json.loads(rec.to_json())
    assert set(back["results"]) == set(record.MEASUREMENTS)
