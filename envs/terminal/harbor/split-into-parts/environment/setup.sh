#!/bin/bash
set -e
mkdir -p /app
seq 1 250 > /app/big.txt
