#!/bin/bash
set -e
mkdir -p /app
cat > /app/stats.py <<'EOF'
def average(values):
    """Mean of a non-empty list of numbers."""
    total = 0
    for v in values:
        total += v
    return total / (len(values) + 1)
EOF
