import json
import re

import pytest
import torch
from helpers import ROOT

from mpguide import MPGuideError
from mpguide.autocast import policy
from mpguide.core import state, versions
from mpguide.versions import diffs, probes

RECORDED = ROOT / "docs" / "recorded" / "versions"


def _doc(version, switches=None, facts=None, autocast=None, build="CPU-only"):
    prov = dict.fromkeys(("python", "machine", "date", "command"), "x")
    doc = {"schema": 1, "provenance": {**prov, "torch": version, "build": build}}
    for group, value in (("switches", switches), ("facts", facts), ("autocast", autocast)):
        if value is not None:
            doc[group] = value
    return doc


def _op(kind, *out, casts=()):
    return {"class": kind, "out": list(out), "casts": list(casts)}


# The probes ------------------------------------------------------------------------------------


def test_dumps_puts_one_entry_per_line_below_the_flat_depth_and_sorts_keys():
    doc = {"b": {"cpu/bf16": {"ops": {"mm": _op("lower precision", "bf16", "bf16", "")}}}, "a": 1}
    text = probes.dumps(doc)
    assert json.loads(text) == doc
    lines = text.splitlines()
    assert lines[1].startswith(' "a"'), "keys sorted"
    mm = [line for line in lines if '"mm"' in line]
    assert (
        len(mm) == 1
        and json.loads(mm[0].split(": ", 1)[1].rstrip(",")) == doc["b"]["cpu/bf16"]["ops"]["mm"]
    )


def test_a_fact_name_takes_one_probe(monkeypatch):
    monkeypatch.setattr(probes, "FACTS", {})
    probes.fact("x")(lambda: "a")
    with pytest.raises(ValueError, match="two probes"):
        probes.fact("x")(lambda: "b")


def test_a_failing_fact_probe_is_recorded_by_its_exception_type(monkeypatch):
    def broken():
        raise KeyError("wording torch does not promise")

    monkeypatch.setattr(probes, "FACTS", {"ok": lambda: "float32", "broken": broken})
    assert probes.facts() == {"broken": "probe failed: raises KeyError", "ok": "float32"}


def test_switches_read_the_state_of_this_process():
    before = probes.switches()["backends.cudnn.allow_tf32"]
    with state.preserved():
        torch.backends.cudnn.allow_tf32 = not before
        assert probes.switches()["backends.cudnn.allow_tf32"] == (not before)
    assert probes.switches()["backends.cudnn.allow_tf32"] == before


def test_a_switch_this_torch_lacks_is_recorded_absent(monkeypatch):
    monkeypatch.setattr(probes, "SWITCHES", ("cuda.matmul.no_such_switch",))
    assert probes.switches()["backends.cuda.matmul.no_such_switch"] == "absent"


def test_autocast_probe_records_class_and_dtypes_per_device_and_dtype():
    ops = tuple(op for op in policy.CATALOGUE if op.name in ("mm", "exp"))
    got = probes.autocast(("cpu", "no_such_device"), ops)
    assert set(got) == {
        f"{d}/{t}" for d in ("cpu", "no_such_device") for t in ("bfloat16", "float16")
    }
    assert got["no_such_device/bfloat16"] == {"how": "this build cannot simulate it"}
    cpu = got["cpu/bfloat16"]
    assert cpu["how"] == "live" and set(cpu["ops"]) == {"mm", "exp"}
    assert cpu["ops"]["mm"]["class"] == policy.LOWER
    assert cpu["ops"]["mm"]["out"][0] == "bfloat16"
    assert "float32->bfloat16" in cpu["ops"]["mm"]["casts"]


def test_every_change_of_the_versions_table_has_a_probe():
    missing = sorted(set(versions.CHANGES) - set(probes.FACTS))
    assert not missing, f"changes without a probe in probes: {missing}"


def test_the_fact_probes_answer_in_words_on_the_side_of_the_versions_table():
    got = probes.facts(("addmv_cpu_mixed_bias", "rms_norm_cuda_autocast"))
    if versions.change("addmv_cpu_mixed_bias").holds:
        assert re.fullmatch(r"raises \w+", got["addmv_cpu_mixed_bias"])
    else:
        assert got["addmv_cpu_mixed_bias"] == "float32"
    holds = versions.change("rms_norm_cuda_autocast").holds
    assert got["rms_norm_cuda_autocast"] == ("has a kernel" if holds else "no kernel")


def test_load_refuses_what_is_not_a_recording(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"schema": 99}))
    with pytest.raises(MPGuideError, match="not a version recording"):
        probes.load(path)
    path.write_text("{")
    with pytest.raises(MPGuideError, match="cannot read"):
        probes.load(path)


def test_one_file_per_release_and_build():
    assert probes.filename("2.13.0+cpu") != probes.filename("2.13.0+cu130")


# The renderer ----------------------------------------------------------------------------------


def test_step_keeps_only_what_changed_and_counts_the_rest():
    a = _doc(
        "2.11.0",
        switches={"s1": True, "s2": "none"},
        autocast={"cuda/bf16": {"how": "simulated", "ops": {"mm": _op("x", "a"), "n": _op("y")}}},
    )
    b = _doc(
        "2.12.1",
        switches={"s1": True, "s2": "tf32", "s3": False},
        autocast={"cuda/bf16": {"how": "simulated", "ops": {"mm": _op("x", "a"), "n": _op("z")}}},
    )
    s = diffs.step(a, b)
    changed = {row: (x, y) for row, x, y in s.changed}
    assert changed == {
        ("switches", "", "s2"): ("none", "tf32"),
        ("switches", "", "s3"): (None, False),
        ("autocast", "cuda/bf16", "n"): ("y ()", "z ()"),
    }
    assert s.counts() == {"autocast": (1, 2), "switches": (2, 1)}
    rows = s.table().rows
    assert ("switches", "", "s3", diffs.ABSENT, "false") in rows
    assert s.table("autocast").rows == (("autocast", "cuda/bf16", "n", "y ()", "z ()"),)


def test_compare_orders_releases_by_number_not_by_text():
    docs = [_doc(v, switches={"s": v}) for v in ("2.9.0", "2.14.1", "2.10.0")]
    h = diffs.compare(docs)
    assert [(s.before, s.after) for s in h.steps] == [("2.9.0", "2.10.0"), ("2.10.0", "2.14.1")]
    t = h.timeline("switches")
    assert t.columns == ("where", "what", "2.9.0", "2.10.0", "2.14.1", "changed in")
    assert t.rows == (("", "s", "2.9.0", "2.10.0", "2.14.1", "2.10, 2.14"),)


def test_series_takes_the_standard_build_of_each_release_and_builds_compares_the_rest():
    cuda = "CUDA 13.0 libraries, no GPU"
    docs = [
        _doc("2.13.0+cpu", switches={"s": 1}),
        _doc("2.13.0+cu130", switches={"s": 2}, build=cuda),
        _doc("2.12.0+cpu", switches={"s": 2}),
    ]
    assert [d["provenance"]["torch"] for d in diffs.series(docs)] == [
        "2.12.0+cpu",
        "2.13.0+cu130",
    ]
    (b,) = diffs.builds(docs)
    assert (b.before, b.after) == ("2.13.0+cu130", "2.13.0+cpu")
    assert b.changed == ((("switches", "", "s"), 2, 1),)
    assert diffs.compare(docs).steps[0].changed == ()


def test_check_changes_agrees_only_when_the_probe_flips_at_the_named_release():
    docs = [_doc(v, facts={"f": o}) for v, o in (("2.11.0", "a"), ("2.12.0", "a"), ("2.13.0", "b"))]
    right = versions.Change("f", "2.13", "a", "b")
    wrong = versions.Change("f", "2.12", "a", "b")
    unprobed = versions.Change("g", "2.12", "a", "b")
    checks = diffs.check_changes(docs, {"f": right, "g": unprobed})
    assert [c.verdict.split(":")[0] for c in checks] == ["agrees", "not probed"]
    (bad,) = diffs.check_changes(docs, {"f": wrong})
    assert not bad.ok and "inside one side" in bad.verdict
    flat = [_doc(v, facts={"f": "a"}) for v in ("2.11.0", "2.13.0")]
    (none,) = diffs.check_changes(flat, {"f": right})
    assert not none.ok and "no change at 2.13" in none.verdict


def test_disagreements_compare_only_the_groups_the_live_probe_holds():
    recorded = _doc("2.13.0", switches={"s": True}, facts={"f": "a"})
    assert diffs.disagreements(_doc("2.13.0", switches={"s": True}), recorded) == []
    live = _doc("2.13.0", switches={"s": False})
    assert diffs.disagreements(live, recorded) == [(("switches", "", "s"), True, False)]


def test_matching_needs_the_same_version_and_build():
    docs = [_doc("2.14.1", build="CUDA 13.0 libraries, no GPU"), _doc("2.13.0+cpu")]
    assert diffs.matching(docs, "2.13.0+cpu", "CPU-only") is docs[1]
    assert diffs.matching(docs, "2.14.1", "CUDA 13.0 libraries, H100") is None


# The recordings in the repository ---------------------------------------------------------------


def _recorded():
    return diffs.recordings(RECORDED)


def test_the_recordings_span_the_window_in_the_standard_build_in_canonical_form():
    docs = _recorded()
    releases = [versions.release(d["provenance"]["torch"]) for d in docs]
    assert releases[0] == versions.release(versions.WINDOW[0])
    assert releases[-1] == versions.release(versions.WINDOW[1])
    assert all(diffs.standard(d) for d in diffs.series(docs))
    for path in sorted(RECORDED.glob("*.json")):
        doc = probes.load(path)
        assert path.name == probes.filename(doc["provenance"]["torch"])
        assert path.read_text() == probes.dumps(doc) + "\n", f"{path.name} not canonical"


def test_noxfile_releases_match_the_window():
    text = (ROOT / "noxfile.py").read_text()
    releases = re.search(r"^RELEASES = \((.*)\)$", text, re.MULTILINE)[1]
    pins = re.findall(r'"([\d.*]+)"', releases)
    assert versions.release(pins[0]) == versions.release(versions.WINDOW[0])
    assert versions.release(pins[-1]) == versions.release(versions.WINDOW[1])


def test_this_torch_agrees_with_its_own_recording_where_there_is_one():
    doc = diffs.matching(_recorded(), torch.__version__, probes.build())
    if doc is None:
        pytest.skip(f"no recording of torch {torch.__version__} ({probes.build()})")
    cheap = ("addmv_cpu_mixed_bias", "quantile_bf16", "rms_norm_cuda_autocast")
    live = {"schema": 1, "provenance": doc["provenance"], "facts": probes.facts(cheap)}
    live["switches"] = probes.switches()
    recorded = {**doc, "facts": {k: doc["facts"][k] for k in cheap}}
    assert diffs.disagreements(live, recorded) == []
