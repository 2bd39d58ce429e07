#!/bin/bash
set -e
mkdir -p /app
printf 'id,region,amount\n1,north,120\n2,south,75\n3,north,300\n4,east,5\n' > /app/sales.csv
