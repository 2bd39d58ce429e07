#!/bin/bash
# terminal-bench's convention: the harness sets TEST_DIR; pytest reports with -rA.
cd "${TEST_DIR:-/tests}" && PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -p no:cacheprovider -rA "${TEST_DIR:-/tests}/test_outputs.py"
