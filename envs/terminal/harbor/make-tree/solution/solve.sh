#!/bin/bash
while IFS= read -r p; do mkdir -p "/app/out/$p"; done < /app/paths.txt
