#!/bin/bash
cd /app && tar --exclude='*.log' -czf project.tar.gz project
