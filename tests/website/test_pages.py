"""The website's pages from executed notebooks (docs/website/pages.py): every notebook in the index's order with
no hand-kept list, outputs a browser can show without a kernel, each exercise's stub and hints under its
check, papers linked, and a bibliography that keeps up with the lectures."""
from __future__ import annotations

from pathlib import Path

import nbformat

from docs.website import pages
from exercises.grading import leaks

ROOT = Path(__file__).resolve().parents[2]
WIDGET = {"version_major": 2, "version_minor": 0, "model_id": "abc"}


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_the_site_shows_the_index_then_the_lectures_it_links_then_any_other_notebook(tmp_path):
    links = "| 1 | [B](b_second.ipynb) |\n| 2 | [A](a_first.ipynb) | [B again](b_second.ipynb) [gone](zz_gone.ipynb)"
    nbformat.write(_notebook(nbformat.v4.new_markdown_cell(links)), tmp_path / "index.ipynb")
    for name in ("a_first", "b_second", "c_not_in_the_index_yet"):
        nbformat.write(_notebook(), tmp_path / f"{name}.ipynb")
    assert pages.lecture_order(tmp_path) == ["index", "b_second", "a_first", "c_not_in_the_index_yet"]
    course = pages.lecture_order(ROOT / "notebooks")
    assert course[0] == "index" and sorted(course) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_outputs_keep_what_plays_without_a_kernel():
    replay = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": WIDGET, "text/html": "<div class='course-animation'></div>",
        "image/png": "iVBORw0KGgo=", "text/plain": "<Player: 4 steps>"})
    quiz = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": WIDGET, "text/plain": "Predict: which rank?\n  ( ) 0"})
    bare = nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": WIDGET, "text/plain": "VBox(children=(Button(),))"})
    cell = nbformat.v4.new_code_cell("show()", outputs=[replay, quiz, bare])
    nb = _notebook(cell)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    out = pages.prepare(nb)
    shown = [o["data"] for o in out.cells[0].outputs]
    assert "widgets" not in out.metadata and all("application/vnd.jupyter.widget-view+json" not in d for d in shown)
    assert set(shown[0]) == {"text/html", "image/png", "text/plain"}
    assert shown[1]["text/plain"].startswith("Predict: which rank?")
    assert shown[2]["text/plain"] == "(an interactive widget: run the notebook to use it)"
    assert "widgets" in nb.metadata and "application/vnd.jupyter.widget-view+json" in cell.outputs[0]["data"]  # a copy


def test_a_grading_cell_is_followed_by_the_stub_and_its_hints_and_no_solution_line():
    import exercises
    out = pages.prepare(_notebook(nbformat.v4.new_code_cell('from exercises import check\ncheck("0.1")')))
    assert len(out.cells) == 2
    note = out.cells[1].source
    assert "def ring_reduce_scatter(tensor: torch.Tensor, *, group=None) -> torch.Tensor:" in note
    assert "def ring_all_reduce(" in note and "`exercises/collectives.py`" in note
    tiers = exercises.hints()["0.1"]
    assert note.count("<details><summary>Hint ") == len(tiers) == 3 and f"Hint 3 of {len(tiers)}" in note
    assert "raise NotImplementedError" not in note and not leaks.find_leaks(note)
    assert pages.exercise_note("99.9") is None


def test_papers_link_to_their_abstract_and_a_partial_site_drops_links_to_pages_it_lacks():
    md = nbformat.v4.new_markdown_cell("Ring Attention (arXiv:2310.01889); [FlashAttention](https://arxiv.org/abs/"
                                       "2205.14135); see [lecture 3](03_data_parallelism.ipynb) and "
                                       "[0](00_ranks_and_collectives.ipynb)")
    out = pages.prepare(_notebook(md), pages={"index", "00_ranks_and_collectives"}).cells[0].source
    assert "[arXiv:2310.01889](https://arxiv.org/abs/2310.01889)" in out
    assert out.count("arxiv.org/abs/2205.14135") == 1
    assert "see lecture 3 and [0](00_ranks_and_collectives.ipynb)" in out


def test_the_index_carries_the_table_of_contents():
    index = pages.prepare(_notebook(nbformat.v4.new_markdown_cell("# Course")), toc=["00_a", "03_b"])
    toc = index.cells[-1].source
    assert "```{toctree}\n:hidden:\n:caption: Lectures\n\n00_a\n03_b\n```" in toc
    assert all(page in toc for page in ("run_it_yourself", "references", "changelog"))
    assert all((ROOT / "docs" / "website" / f"{p}.md").exists() for p in ("run_it_yourself",))


def test_every_paper_the_lectures_cite_is_in_the_bibliography_and_every_entry_is_cited():
    books = {p.stem: nbformat.read(p, as_version=4) for p in (ROOT / "notebooks").glob("*.ipynb")}
    texts = {s: "\n".join(c.source for c in nb.cells if c.cell_type == "markdown") for s, nb in books.items()}
    cited = {a for t in texts.values() for a in pages.cited(t)}
    bibliography = (ROOT / "docs" / "references.md").read_text()
    listed = set(pages.cited(bibliography))
    assert cited - listed == set(), f"cited by a lecture, missing from docs/references.md: {sorted(cited - listed)}"
    assert listed - cited == set(), f"in docs/references.md, cited by no lecture: {sorted(listed - cited)}"
    titles = {s: pages.notebook_title(nb) for s, nb in books.items() if s != "index"}
    page = pages.references_page(bibliography, titles, texts)
    ring = next(ln for ln in page.splitlines() if "2310.01889" in ln)
    assert "Cited in [" in ring and "(05a_sequence_parallelism.ipynb)" in ring


def test_make_site_is_a_teachers_command_the_student_release_leaves_out():
    import subprocess

    from exercises.grading.release import student_makefile
    makefile = (ROOT / "Makefile").read_text()
    assert "\nsite:" in makefile and "site:" not in student_makefile(makefile)
    dry = subprocess.run(["make", "-n", "site", "RELEASE=rel/x", "ONLY=04b_pipeline_parallelism"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "docs/website/build.py --out site --release rel/x --only 04b_pipeline_parallelism" in dry


def test_a_notebook_as_jupyterlab_ran_it_is_kept_for_the_site(tmp_path):
    """tests/notebook/test_browser.py keeps each release notebook as JupyterLab's model holds it (its JSON has
    ``"attachments": null`` on markdown cells) for tests/website/test_site.py."""
    from tests.release_notebooks import keep_run
    source = ROOT / "notebooks" / "index.ipynb"
    lab_cells = [{"id": "a1", "cell_type": "markdown", "metadata": {}, "source": "# Course", "attachments": None},
                 {"id": "c1", "cell_type": "code", "metadata": {}, "source": "1 + 1", "execution_count": 1,
                  "outputs": [{"output_type": "execute_result", "execution_count": 1, "metadata": {},
                               "data": {"text/plain": "2", "text/html": "<b>2</b>"}}]}]
    keep_run(lab_cells, source, tmp_path / "index.ipynb")
    kept = nbformat.read(tmp_path / "index.ipynb", as_version=4)
    assert kept.metadata == nbformat.read(source, as_version=4).metadata
    assert [c.cell_type for c in kept.cells] == ["markdown", "code"]
    assert kept.cells[1].outputs[0]["data"]["text/html"] == "<b>2</b>"
