#!/bin/bash
set -e
mkdir -p /app
printf '10\n-3\n250\n7\n99\n0\n' > /app/numbers.txt
