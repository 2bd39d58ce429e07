#!/bin/bash
mkdir -p /app/parts && split -l 100 -d -a 2 /app/big.txt /app/parts/part_
