from pathlib import Path

import pytest

from envs.gui.page import html_root, read_page_file
from envs.gui.tasks import SPLITS, all_tasks, load_split, split_of


def test_task_set_covers_every_miniwob_page_once():
    pages = sorted(p.stem for p in (html_root() / "miniwob").glob("*.html"))
    names = [task.name for task in all_tasks()]
    assert len(pages) == 130
    assert sorted(names) == pages


def test_families_never_straddle_the_split_and_both_splits_have_tasks():
    split_of_family: dict[str, set[str]] = {}
    for task in all_tasks():
        split_of_family.setdefault(task.family, set()).add(task.split)
    assert all(len(splits) == 1 for splits in split_of_family.values())
    train, test = load_split("train"), load_split("test")
    assert len(train.tasks) > 80 and len(test.tasks) >= 15
    assert not {t.name for t in train.tasks} & {t.name for t in test.tasks}
    assert {t.family for t in test.tasks}.isdisjoint({t.family for t in train.tasks})


def test_seed_ranges_are_disjoint_and_test_seen_pairs_train_tasks_with_test_seeds():
    train, test, seen = (load_split(s) for s in SPLITS)
    assert train.seeds[1] <= test.seeds[0] or test.seeds[1] <= train.seeds[0]
    assert seen.tasks == train.tasks and seen.seeds == test.seeds
    # Variants land together: click-tab-2 and its harder versions are one family.
    assert len({split_of(n) for n in ("click-tab-2", "click-tab-2-hard", "click-tab-2-easy")}) == 1


def test_unknown_split_and_tasks_outside_the_split_are_refused():
    with pytest.raises(ValueError, match="unknown split"):
        load_split("validation")
    held_out = load_split("test").tasks[0].name
    with pytest.raises(ValueError, match="not in split 'train'"):
        load_split("train", (held_out,))
    assert [t.name for t in load_split("train", ("click-test",)).tasks] == ["click-test"]


@pytest.mark.parametrize(
    "path", ["/../../etc/passwd", "/miniwob/../../environment.py", "/%2e%2e/x"]
)
def test_files_outside_the_html_folder_are_never_served(path):
    assert read_page_file(path) is None


def test_task_files_are_served_with_their_type():
    body, kind = read_page_file("/miniwob/click-test.html")
    assert b"genProblem" in body and kind.startswith("text/html")
    assert read_page_file("/core/core.js")[1].startswith(
        ("text/javascript", "application/javascript")
    )
    assert Path(html_root(), "core", "core.js").read_bytes() == read_page_file("/core/core.js")[0]
