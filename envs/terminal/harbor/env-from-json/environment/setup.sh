#!/bin/bash
set -e
mkdir -p /app
echo '{"port": 8080, "host": "0.0.0.0", "debug": false}' > /app/config.json
