"""The terminal environment: bash tasks (terminal-bench format, InterCode-ALFA) in a sandbox."""
