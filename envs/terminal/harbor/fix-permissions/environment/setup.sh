#!/bin/bash
set -e
mkdir -p /app
mkdir -p /app/bin && echo s3cret > /app/secret.txt && chmod 644 /app/secret.txt && printf '#!/bin/sh\necho run\n' > /app/bin/run && chmod 644 /app/bin/run
