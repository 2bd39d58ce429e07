#!/bin/bash
cd /app/files && find . -type f -size +1000c | sed 's|^\./||' | sort > /app/large.txt
