#!/bin/bash
sort -rn /app/numbers.txt > /app/sorted.txt
