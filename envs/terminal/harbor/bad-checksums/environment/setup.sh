#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/files && cd /app/files && for n in a b c d; do echo "content $n" > $n.dat; done && md5sum *.dat > checksums.md5 && echo changed >> b.dat && echo changed > d.dat
