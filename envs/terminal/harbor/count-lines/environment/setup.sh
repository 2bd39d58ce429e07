#!/bin/bash
set -e
mkdir -p /app
for i in $(seq 1 137); do echo "row $i"; done > /app/data.txt
