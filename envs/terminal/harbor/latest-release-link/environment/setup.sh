#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/releases/v2 /app/releases/v9 /app/releases/v10 /app/releases/v1
