"""The HTTP serving stack: the token-exact OpenAI-compatible proxy in front of an engine.

The proxy's state (`proxy`), its routes (`app`, `episode_routes`), one chat-completions
request from validation to its committed turns (`chat_turn`), the sessions it records
(`identity`, `histories`, `sessions`), OpenAI's wire format (`chat_request`,
`openai_api`), the HTTP protocol it is served with (`http_protocol`) and serving an ASGI
app from a thread (`server`). Engines sit below it (`agents.engines`); `agents.compose`
builds it and `python -m agents.serve` runs it.
"""
