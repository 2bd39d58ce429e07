from pathlib import Path


def test_parts():
    parts = sorted(p.name for p in Path("/app/parts").iterdir())
    assert parts == ["part_00", "part_01", "part_02"]


def test_contents_in_order():
    joined = "".join(Path(f"/app/parts/part_{i:02d}").read_text() for i in range(3))
    assert joined == Path("/app/big.txt").read_text()
    assert len(Path("/app/parts/part_02").read_text().splitlines()) == 50
