#!/bin/bash
set -e
mkdir -p /app
printf 'a/b/c\na/d\ne\nf/g h\n' > /app/paths.txt
