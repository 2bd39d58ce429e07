#!/bin/bash
set -e
mkdir -p /app
cat > /app/app.log <<'EOF'
10:00 INFO db: connected
10:01 ERROR db: timeout
10:02 ERROR api: bad request
10:03 WARN api: slow
10:04 ERROR db: timeout
10:05 ERROR auth: denied
EOF
