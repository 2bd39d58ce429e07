#!/bin/bash
set -e
mkdir -p /app
printf '09:15:00 GET /\n09:59:59 GET /a\n10:00:01 POST /b\n13:30:00 GET /\n13:31:00 GET /c\n13:32:00 GET /d\n' > /app/access.log
