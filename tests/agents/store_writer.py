"""A writer process for the store's crash tests: commits turns to a store and reports each
committed sequence number on stdout, one per line, until it is killed.

    python -m tests.agents.store_writer STORE_PATH SESSION_ID COUNT
"""

import sys

from agents.store import Store
from agents.trajectory import Session
from tests.agents.test_trajectory import make_turn


def main() -> None:
    path, session_id, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = Store(path)
    store.add_session(Session(session_id, "clawgym/Test-v0"))
    for index in range(count):
        seq = store.add_turn(
            make_turn(
                session_id=session_id,
                index=index,
                completion_token_ids=(index, 7),
                completion_logprobs=(-0.1, -0.2),
            )
        )
        sys.stdout.write(f"{seq}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
