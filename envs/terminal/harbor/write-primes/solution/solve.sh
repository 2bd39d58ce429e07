#!/bin/bash
cat > /app/primes.py <<'EOF'
def primes(n):
    return [k for k in range(2, n) if all(k % d for d in range(2, int(k ** 0.5) + 1))]
EOF
