from pathlib import Path


def test_conf_files_rewritten():
    assert Path("/app/etc/a.conf").read_text() == "host=db.internal\n"
    assert Path("/app/etc/sub/b.conf").read_text() == "x=db.internal\ny=db.internal:5432\n"


def test_other_files_untouched():
    assert Path("/app/etc/notes.txt").read_text() == "host=localhost\n"
