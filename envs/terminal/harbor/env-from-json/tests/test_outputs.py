from pathlib import Path


def test_env_lines():
    assert Path("/app/.env").read_text().split() == ["DEBUG=false", "HOST=0.0.0.0", "PORT=8080"]
