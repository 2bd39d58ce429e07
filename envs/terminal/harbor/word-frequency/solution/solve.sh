#!/bin/bash
tr -cs 'A-Za-z' '\n' < /app/text.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c | sort -rn | head -1 | awk '{print $2}' > /app/top_word.txt
