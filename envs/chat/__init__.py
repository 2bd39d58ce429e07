"""`clawgym/Chat-v0`: the personal-agent environment (simulated users with personas).

`env.py` runs the conversation, `user.py` is the simulated user, `personas.py` holds the
personas and their evaluation-only preference checks, `tasks.py` the questions and splits.
"""
