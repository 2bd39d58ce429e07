"""A real proxy server for the tests: uvicorn on a free loopback port, in a thread of the
test process (`agents.serve.in_thread`), talked to with the official `openai` client."""

from agents.serve import in_thread as running

__all__ = ["running"]
