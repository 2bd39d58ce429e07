#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/project/src && echo 'print(1)' > /app/project/src/main.py && echo notes > /app/project/README && echo noise > /app/project/debug.log && echo more > /app/project/src/run.log
