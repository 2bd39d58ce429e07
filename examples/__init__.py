"""Examples of extending clawgym from outside its packages (docs/environments.md)."""
