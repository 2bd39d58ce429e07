#!/bin/bash
ln -sfn "/app/releases/$(ls /app/releases | sort -V | tail -1)" /app/latest
