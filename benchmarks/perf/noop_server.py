"""An HTTP server that answers every request at once with a fixed chat completion, on the
same stack as the proxy (uvicorn, uvloop, httptools with coalesced writes): the floor
under the proxy's overhead in `benchmarks.perf.serving` (the client, the loopback, waking
an idle process).

    python -m benchmarks.perf.noop_server PORT
"""

from __future__ import annotations

import json
import sys
from typing import Any

REPLY = json.dumps(
    {
        "id": "chatcmpl-noop",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
    }
).encode()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(REPLY))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": REPLY})


def main() -> None:
    import uvicorn

    from agents.serving.http_protocol import CoalescingHttpProtocol

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        http=CoalescingHttpProtocol,
    )


if __name__ == "__main__":
    main()
