"""clawgym environments over OpenEnv (PyPI `openenv-core`), both ways.

`server`: any registered `clawgym/` env served over OpenEnv's WebSocket protocol, one env
instance per session (`python -m envs.openenv serve clawgym/Arith-v0 --port 8010`).
`env`: `clawgym/OpenEnv-v0`, a Gymnasium env that plays an env served that way elsewhere.
`protocol`: the action, observation and state messages both sides share, and the client.
"""
