#!/bin/bash
tr 'A-Z' 'a-z' < /app/emails.txt | sort -u > /app/unique.txt
