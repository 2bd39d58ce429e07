#!/bin/bash
cut -c1-2 /app/access.log | sort | uniq -c | awk '{print $2, $1}' > /app/hourly.txt
