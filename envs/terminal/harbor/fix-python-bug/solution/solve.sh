#!/bin/bash
sed -i 's|total / (len(values) + 1)|total / len(values)|' /app/stats.py
