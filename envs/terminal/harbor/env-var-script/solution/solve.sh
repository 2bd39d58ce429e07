#!/bin/bash
printf '#!/bin/sh\necho "${APP_MODE:-unset}"\n' > /app/show_env.sh && chmod +x /app/show_env.sh
