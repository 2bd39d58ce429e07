#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/files/a/b && head -c 500 /dev/zero > /app/files/small.bin && head -c 2000 /dev/zero > /app/files/big.bin && head -c 1500 /dev/zero > /app/files/a/b/deep.bin && head -c 1000 /dev/zero > /app/files/a/exact.bin
