#!/bin/bash
set -e
mkdir -p /app
printf 'The cat and the dog.\nA cat saw THE bird\nthe end\ncat cat\n' > /app/text.txt
