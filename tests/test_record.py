import json
import re

import pytest
import site_recordings
import torch
from helpers import ROOT

from mpguide import MPGuideError
from mpguide.core import record
from mpguide.core.table import Table

# Slow: runs the site's recordings (nox -s tests -- -m 'not slow' leaves it out).
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@pytest.fixture
def tiny(monkeypatch):
    table = Table(("op", "dtype"), (("mm", torch.bfloat16),), "caption")
    monkeypatch.setattr(site_recordings, "MEASUREMENTS", {"t.one": lambda dev: table})
    return table


def measure(command="cmd"):
    tables = {key: fn(CPU) for key, fn in site_recordings.MEASUREMENTS.items()}
    return record.Recording(record.provenance(CPU, command), tables)


def test_a_recording_round_trips_with_its_provenance(tmp_path, tiny):
    rec = measure("python -m mpguide record --allow-cpu")
    path = record.save(rec, tmp_path / "cpu.json")
    back = record.load(path)
    assert back.provenance == rec.provenance
    assert back.provenance.torch == torch.__version__
    assert back.provenance.command == "python -m mpguide record --allow-cpu"
    assert back.tables["t.one"].rows == (("mm", "bfloat16"),)
    assert back.tables["t.one"].caption == "caption"


def test_the_schema_has_every_provenance_field(tmp_path, tiny):
    doc = json.loads(measure().to_json())
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


def test_unknown_keys_are_refused(capsys, tmp_path, tiny):
    argv = ["--allow-cpu", "--device", "cpu", "--out", str(tmp_path), "--only", "nope"]
    assert site_recordings.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'nope'" in err


def test_a_failing_measurement_keeps_the_others(capsys, monkeypatch, tmp_path, tiny):
    def fails(dev):
        raise RuntimeError("a kernel refused")

    monkeypatch.setitem(site_recordings.MEASUREMENTS, "t.bad", fails)
    monkeypatch.setitem(site_recordings.MEASUREMENTS, "t.two", lambda dev: tiny)
    argv = ["--allow-cpu", "--device", "cpu", "--out", str(tmp_path)]
    assert site_recordings.main(argv) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: a kernel refused" in err and err.endswith("failed: t.bad\n")
    (path,) = tmp_path.glob("*.json")
    assert set(record.load(path).tables) == {"t.one", "t.two"}


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


def test_the_site_script_refuses_a_cpu_without_the_flag(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert site_recordings.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-cpu" in err
    assert list(tmp_path.iterdir()) == []


def test_the_site_script_records_a_cpu_on_request(capsys, tmp_path, tiny):
    argv = ["--allow-cpu", "--device", "cpu", "--out", str(tmp_path)]
    assert site_recordings.main(argv) == 0
    captured = capsys.readouterr()
    assert "[1/1] t.one" in captured.err
    (path,) = tmp_path.glob("*.json")
    assert captured.out == f"wrote {path}\n"
    assert record.load(path).provenance.command.startswith("python docs/site_recordings.py")


def test_recordings_are_found_through_the_environment(tmp_path, monkeypatch, tiny):
    rec = measure()
    record.save(rec, tmp_path / "gpu.json")
    monkeypatch.setenv("MPGUIDE_RECORDED", str(tmp_path))
    assert [r.provenance for r in record.recordings()] == [rec.provenance]
    assert record.beside("t.one").recorded[0][1].rows == (("mm", "bfloat16"),)
    monkeypatch.delenv("MPGUIDE_RECORDED")
    assert record.recordings() == []
    assert "set MPGUIDE_RECORDED" in repr(record.beside("t.one"))


def test_every_key_a_page_shows_is_measured():
    root = ROOT / "examples"
    shown = set()
    for path in root.rglob("plot_*.py"):
        shown |= set(re.findall(r'record\.beside\(\s*"([^"]+)"', path.read_text()))
    assert shown, "no page shows a recording"
    assert shown <= set(site_recordings.MEASUREMENTS)


def test_every_measurement_runs_on_the_cpu():
    rec = measure()
    assert set(rec.tables) == set(site_recordings.MEASUREMENTS)
    assert all(t.rows for t in rec.tables.values())
    back = json.loads(rec.to_json())
    assert set(back["results"]) == set(site_recordings.MEASUREMENTS)
