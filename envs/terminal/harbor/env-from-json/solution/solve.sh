#!/bin/bash
python3 -c "import json; c=json.load(open('/app/config.json')); print('\n'.join(f'{k.upper()}={json.dumps(v) if not isinstance(v, str) else v}' for k, v in sorted(c.items())))" > /app/.env
