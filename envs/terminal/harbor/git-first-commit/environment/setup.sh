#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/repo && echo 'hello' > /app/repo/hello.txt && echo 'world' > /app/repo/world.txt
