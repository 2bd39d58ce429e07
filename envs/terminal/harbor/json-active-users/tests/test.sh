#!/bin/bash
# Harbor verifier: 1 in /logs/verifier/reward.txt when every test passes, else 0.
mkdir -p /logs/verifier
cd /tests && PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -p no:cacheprovider -rA --confcutdir=/tests /tests
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
