#!/bin/bash
cd /app/files && md5sum -c checksums.md5 2>/dev/null | grep -v ': OK$' | cut -d: -f1 | sort > /app/bad.txt
