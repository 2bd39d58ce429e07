from pathlib import Path


def test_no_txt_left():
    assert not list(Path("/app/docs").glob("*.txt"))


def test_md_files_with_contents():
    for name in ("intro", "usage", "faq"):
        assert Path(f"/app/docs/{name}.md").read_text().strip() == f"# {name}"
