#!/bin/bash
awk '$2 == "ERROR" {sub(":", "", $3); c[$3]++} END {for (m in c) print m "," c[m]}' /app/app.log | sort > /app/errors.csv
