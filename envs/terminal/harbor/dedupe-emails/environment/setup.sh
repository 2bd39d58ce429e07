#!/bin/bash
set -e
mkdir -p /app
printf 'Ann@example.com\nbob@example.com\nann@example.com\nCARL@example.com\nbob@example.com\n' > /app/emails.txt
