#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/etc/sub && echo 'host=localhost' > /app/etc/a.conf && printf 'x=localhost\ny=localhost:5432\n' > /app/etc/sub/b.conf && echo 'host=localhost' > /app/etc/notes.txt
