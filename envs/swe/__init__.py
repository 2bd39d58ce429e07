"""clawgym/SWE-v0: real bugs in real Python projects (sources.py, tasks.py, workspace.py,
grading.py, env.py)."""
