#!/bin/bash
find /app/etc -name '*.conf' -exec sed -i 's/localhost/db.internal/g' {} +
