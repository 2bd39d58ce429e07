#!/bin/bash
python3 -c "import json; print('\n'.join(sorted(u['name'] for u in json.load(open('/app/users.json')) if u['active'])))" > /app/active.txt
