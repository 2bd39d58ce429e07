#!/bin/bash
chmod 600 /app/secret.txt && chmod a+x /app/bin/run
