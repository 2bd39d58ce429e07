#!/bin/bash
cd /app/repo && git init -q && git add -A && git -c user.name=agent -c user.email=agent@example.com commit -q -m 'initial import'
