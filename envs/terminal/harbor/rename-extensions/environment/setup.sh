#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/docs && for n in intro usage faq; do echo "# $n" > /app/docs/$n.txt; done
