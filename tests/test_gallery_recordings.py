"""docs/gallery_recordings.py: the gallery's GPU output harvested with its provenance, and shown
beside the live output block by block. The recordings here are fixtures made in the test, on a
GPU that does not exist ("FAKE GPU (test fixture)"); no real GPU recording is stored yet."""

import json

import gallery_recordings as gr
import pytest
from matplotlib.figure import Figure
from PIL import Image

from mpguide import MPGuideError


def page(printed: str, figure: bool = True, failing: str | None = None) -> str:
    """A page as sphinx-gallery 0.22 writes it: prose, two code blocks and the footer."""
    image = (
        "\n\n.. container:: mpguide-figure\n\n"
        "   .. image-sg:: /docs/auto_examples/ch/images/sphx_glr_plot_01_x_001.png\n"
        "      :alt: a figure\n"
        "      :srcset: /docs/auto_examples/ch/images/sphx_glr_plot_01_x_001.png\n"
        "      :class: sphx-glr-single-img\n\n\n"
        if figure
        else ""
    )
    second = (
        ".. rst-class:: sphx-glr-script-out\n\n.. code-block:: pytb\n\n"
        "    Traceback (most recent call last):\n"
        '      File "plot_01_x.py", line 9, in <module>\n'
        f"    {failing}\n\n\n\n"
        if failing
        else f".. rst-class:: sphx-glr-script-out\n\n .. code-block:: none\n\n    {printed}\n\n\n\n"
    )
    return (
        ".. DO NOT EDIT.\n\n.. _sphx_glr_docs_auto_examples_ch_plot_01_x.py:\n\n\n"
        "A page\n======\n\nWhat it asks.\n\n"
        ".. GENERATED FROM PYTHON SOURCE LINES 6-8\n\n"
        ".. code-block:: Python\n\n    import torch\n    x = torch.ones(2)\n\n\n\n\n"
        f"{image}"
        ".. GENERATED FROM PYTHON SOURCE LINES 9-11\n\nProse between.\n\n"
        ".. GENERATED FROM PYTHON SOURCE LINES 11-12\n\n"
        ".. code-block:: Python\n\n    print(x.dtype)\n\n\n\n\n"
        f"{second}"
        ".. _sphx_glr_download_docs_auto_examples_ch_plot_01_x.py:\n\n.. only:: html\n\n"
        "  footer\n"
    )


@pytest.fixture
def built(tmp_path):
    """An examples tree of three pages and the gallery a build made of it: one page passed,
    one failed, one did not run."""
    root, gallery = tmp_path / "repo", tmp_path / "repo" / "docs" / "auto_examples"
    for name in ("plot_01_x", "plot_02_y", "plot_03_z"):
        (root / "examples" / "ch").mkdir(parents=True, exist_ok=True)
        (root / "examples" / "ch" / f"{name}.py").write_text("")
    (gallery / "ch" / "images").mkdir(parents=True)
    (gallery / "ch" / "plot_01_x.rst").write_text(page("torch.float32"))
    (gallery / "ch" / "plot_01_x.cost.json").write_text('{"time": 3.14159, "memory": 0}')
    failing = "AttributeError: 'NoneType' object has no attribute 'error'"
    (gallery / "ch" / "plot_02_y.rst").write_text(page("", figure=False, failing=failing))
    (gallery / "ch" / "plot_03_z.rst").write_text(page("never ran", figure=False))
    png = gallery / "ch" / "images" / "sphx_glr_plot_01_x_001.png"
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.subplots()
    for k in range(8):
        ax.plot([0, 1, 2], [k, k * k / 4, 2 * k], label=f"line {k}")
    ax.legend()
    fig.savefig(png, dpi=100)
    return root, gallery


def test_blocks_split_a_page_into_code_and_its_output():
    head, found = gr.blocks(page("torch.float32"))
    assert head.endswith("What it asks.\n\n")
    assert [bool(digest) for digest, _, _ in found] == [True, False, True]
    first, _, second = found
    assert ".. image-sg::" in first[2] and "x = torch.ones(2)" in first[1]
    assert "torch.float32" in second[2] and "print(x.dtype)" in second[1]
    assert first[0] != second[0]
    # the same code gives the same hash whatever it printed
    assert gr.blocks(page("torch.bfloat16"))[1][2][0] == second[0]
    assert "".join([head, *(c + o for _, c, o in found)]) == page("torch.float32")


def test_harvest_writes_the_manifest_of_every_example(built, tmp_path):
    root, gallery = built
    out = tmp_path / "rehearsal"
    path = gr.harvest(root, gallery, out, "bash docs/gpu_site.sh --allow-cpu", allow_cpu=True)
    manifest = json.loads(path.read_text())
    assert set(manifest["provenance"]) == {
        "device", "name", "driver", "cuda", "torch", "date", "command"
    }  # fmt: skip
    assert manifest["provenance"]["device"] == "cpu"
    pages = manifest["pages"]
    assert list(pages) == [
        f"examples/ch/plot_0{i}_{c}.py" for i, c in ((1, "x"), (2, "y"), (3, "z"))
    ]
    assert pages["examples/ch/plot_01_x.py"]["status"] == "passed"
    assert pages["examples/ch/plot_01_x.py"]["seconds"] == 3.14
    assert pages["examples/ch/plot_02_y.py"] | {"outputs": None} == {
        "status": "failed",
        "error": "AttributeError: 'NoneType' object has no attribute 'error'",
        "seconds": None,
        "device": pages["examples/ch/plot_01_x.py"]["device"],
        "outputs": None,
    }
    assert pages["examples/ch/plot_03_z.py"]["status"] == "not run"
    stored = json.loads((out / pages["examples/ch/plot_01_x.py"]["outputs"]).read_text())
    first, second = stored["blocks"]
    slug = path.stem
    assert (
        f".. image:: /docs/recorded/gallery/{slug}/ch/{slug}-sphx_glr_plot_01_x_001.png"
        in first["output"]
    )
    assert ":srcset:" not in first["output"]
    assert "torch.float32" in second["output"] and "footer" not in second["output"]
    figure = out / slug / "ch" / f"{slug}-sphx_glr_plot_01_x_001.png"
    with Image.open(figure) as img:
        assert img.mode == "P"  # a palette: the compressed copy
    live = gallery / "ch" / "images" / "sphx_glr_plot_01_x_001.png"
    assert figure.stat().st_size < live.stat().st_size


def test_a_cpu_build_is_never_stored_as_a_gpu_recording(built):
    root, gallery = built
    with pytest.raises(MPGuideError, match="no GPU here"):
        gr.harvest(root, gallery, root / "out", "x")
    with pytest.raises(MPGuideError, match="not a GPU recording"):
        gr.harvest(root, gallery, root / gr.RECORDED, "x", allow_cpu=True)
    assert (
        gr.main(["harvest", "--out", str(root / "o"), "--command", "x", "--gallery", "nope"]) == 2
    )


@pytest.fixture
def fake_gpu(built, tmp_path):
    """A recording harvested from the fixture gallery, relabelled as made on a fake GPU."""
    root, gallery = built
    gpu_page = page("torch.float32 (recorded)")
    (gallery / "ch" / "plot_01_x.rst").write_text(gpu_page)
    out = tmp_path / "recorded"
    path = gr.harvest(root, gallery, out, "bash docs/gpu_site.sh", allow_cpu=True)
    manifest = json.loads(path.read_text())
    manifest["provenance"] |= {
        "device": "cuda",
        "name": "FAKE GPU (test fixture)",
        "driver": "0.0",
        "cuda": "0.0",
        "date": "2000-01-01",
    }
    path.write_text(json.dumps(manifest))
    return out


def test_each_code_block_shows_the_recorded_output_beside_the_live_one(fake_gpu):
    recorded = gr.recordings(fake_gpu)
    assert [r["provenance"]["name"] for r in recorded] == ["FAKE GPU (test fixture)"]
    live = page("torch.float32 (live)")
    shown = gr.beside(live, "examples/ch/plot_01_x.py", recorded, "this build: CPU, live")
    assert shown.count(".. tab-set::") == 2
    assert shown.count("   .. tab-item:: this build: CPU, live") == 2
    gpu_tab = "   .. tab-item:: FAKE GPU (test fixture): recorded on 2000-01-01, torch "
    assert shown.count(gpu_tab) == 2
    live_at = shown.index("torch.float32 (live)")
    assert shown.index("this build: CPU, live", shown.index("print(x.dtype)")) < live_at
    assert live_at < shown.index("torch.float32 (recorded)")
    # the provenance once, under the title, with the page's status
    assert shown.count("GPU recordings of this page") == 1
    assert "CUDA 0.0, driver 0.0, by ``bash docs/gpu_site.sh``: passed in 3.1 s." in shown
    assert shown.index("GPU recordings") < shown.index("import torch")
    assert shown.rstrip().endswith("footer")


def test_a_block_whose_code_changed_since_the_recording_shows_only_the_live_output(fake_gpu):
    live = page("torch.float32 (live)").replace("print(x.dtype)", "print(x.shape)")
    shown = gr.beside(live, "examples/ch/plot_01_x.py", gr.recordings(fake_gpu), "live")
    assert shown.count(".. tab-set::") == 1  # the first block only
    assert "torch.float32 (recorded)" not in shown


def test_without_a_gpu_recording_the_page_is_left_as_built(built, tmp_path):
    live = page("torch.float32")
    assert gr.beside(live, "examples/ch/plot_01_x.py", [], "live") == live
    assert gr.recordings(tmp_path / "none") == []
    # a CPU rehearsal's harvest, wherever it lies, is not shown as a recording
    root, gallery = built
    gr.harvest(root, gallery, tmp_path / "rehearsal", "x", allow_cpu=True)
    assert gr.recordings(tmp_path / "rehearsal") == []


def _stored_manifests():
    return sorted((gr.ROOT / gr.RECORDED).glob("*.json"))


@pytest.mark.parametrize("manifest", _stored_manifests(), ids=lambda p: p.stem)
def test_every_example_passed_on_each_recorded_gpu(manifest):
    """A GPU recording lands only where every page ran there and its assertions held: a page
    whose stated CUDA fact the GPU contradicts fails there (its asserts run live on CUDA, and
    autocast/plot_04 checks its CUDA cells against docs/recorded/), and so fails here."""
    doc = json.loads(manifest.read_text())
    assert doc["provenance"]["device"] == "cuda"
    examples = sorted(
        p.relative_to(gr.ROOT).as_posix() for p in gr.ROOT.glob("examples/*/plot_*.py")
    )
    assert sorted(doc["pages"]) == examples
    failed = {k: v["error"] for k, v in doc["pages"].items() if v["status"] != "passed"}
    assert not failed
    for entry in doc["pages"].values():
        assert (manifest.parent / entry["outputs"]).is_file()


def test_the_chain_is_the_sum_of_each_chapters_slowest_example():
    pages = {
        "examples/a/plot_01.py": {"seconds": 10.0, "status": "passed"},
        "examples/a/plot_02.py": {"seconds": 30.0, "status": "passed"},
        "examples/b/plot_01.py": {"seconds": 5.0, "status": "passed"},
        "examples/b/plot_02.py": {"seconds": None, "status": "not run"},
    }
    total, lines = gr.chain(pages)
    assert total == 35.0
    assert lines == [
        "a: slowest 30.0 s (plot_02.py), all 40.0 s",
        "b: slowest 5.0 s (plot_01.py), all 5.0 s",
        "    not run: examples/b/plot_02.py",
    ]
