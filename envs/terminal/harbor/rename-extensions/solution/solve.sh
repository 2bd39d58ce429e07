#!/bin/bash
cd /app/docs && for f in *.txt; do mv -- "$f" "${f%.txt}.md"; done
