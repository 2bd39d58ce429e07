#!/bin/bash
set -e
mkdir -p /app
cat > /app/users.json <<'EOF'
[{"name": "zoe", "active": true}, {"name": "adam", "active": false},
 {"name": "mia", "active": true}, {"name": "bob", "active": true}]
EOF
