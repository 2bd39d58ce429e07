"""Each user's named checkpoints on a Tinker server held under a count and a byte cap (tiny
model, loopback, the real `tinker` SDK, two keys): past either cap a save is refused with a
403 (the SDK's PermissionDeniedError) or, where only the written size tells, a failed future;
nothing of the refused save stays on disk, a same-name save replaces in place, another user
is not held back, and deleting a checkpoint frees its room."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from trainers.tinker.app import in_thread
from trainers.tinker.limits import TinkerLimits
from trainers.tinker.service import TinkerService

ALICE, BOB = "tml-alice", "tml-bob"


@pytest.fixture
def served(tmp_path, monkeypatch):
    """(url, service, alice's training client, alice's RestClient, bob's ServiceClient)."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = TinkerService("tiny", tmp_path, limits=TinkerLimits(max_checkpoints=2))
    with (
        in_thread(service, api_key=[f"alice {ALICE}", BOB]) as url,
        tinker.ServiceClient(base_url=url, api_key=ALICE) as alice,
        tinker.ServiceClient(base_url=url, api_key=BOB) as bob,
    ):
        trainer = alice.create_lora_training_client(base_model="tiny", rank=4).result()
        yield url, service, trainer, tinker.RestClient(base_url=url, api_key=ALICE), bob


def datum() -> types.Datum:
    prompt = [1, 5, 9, 200, 31, 7]
    targets = np.asarray(prompt[1:] + [2], dtype=np.int64)
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets)},
    )


def names(rest: tinker.RestClient, model_id: str) -> dict[str, int]:
    listed = rest.list_checkpoints(model_id).result().checkpoints
    return {c.checkpoint_id: c.size_bytes for c in listed}


def test_past_the_count_a_save_is_refused_and_a_deletion_frees_a_place(served):
    url, _, trainer, rest, bob = served
    trainer.save_state("a").result()
    trainer.save_weights_for_sampler("b").result()
    with pytest.raises(tinker.PermissionDeniedError, match="max_checkpoints=2"):
        trainer.save_state("c").result()
    trainer.save_state("a").result()  # the same name replaces: no new place taken
    assert set(names(rest, trainer.model_id)) == {"weights/a", "sampler_weights/b"}
    theirs = bob.create_lora_training_client(base_model="tiny", rank=4).result()
    assert theirs.save_state("c").result().path.endswith("/weights/c")  # bob's own quota
    rest.delete_checkpoint(trainer.model_id, "weights/a").result()
    assert trainer.save_state("c").result().path.endswith("/weights/c")
    assert set(names(rest, trainer.model_id)) == {"weights/c", "sampler_weights/b"}


def test_past_the_bytes_a_save_fails_and_leaves_nothing(served, tmp_path):
    _, service, trainer, rest, _ = served
    trainer.save_weights_for_sampler("s1").result()
    size = names(rest, trainer.model_id)["sampler_weights/s1"]
    # The cap is set on the live service (its limits are read at each save): room for two
    # sampler checkpoints and a half, which a training checkpoint (adapter and Adam state,
    # over twice the adapter's size) passes only once written.
    service.limits.max_checkpoints = 100
    service.limits.max_checkpoint_bytes = 2 * size + size // 2
    trainer.forward_backward([datum()], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-4)).result()  # Adam state to save
    with pytest.raises(tinker.RequestFailedError, match="max_checkpoint_bytes"):
        trainer.save_state("w").result()
    assert names(rest, trainer.model_id) == {"sampler_weights/s1": size}
    assert not [p for p in tmp_path.glob("*/staging/*")]  # the refused save is gone
    trainer.save_weights_for_sampler("s2").result()
    service.limits.max_checkpoint_bytes = 2 * size  # full: refused before anything is written
    with pytest.raises(tinker.PermissionDeniedError, match="max_checkpoint_bytes"):
        trainer.save_weights_for_sampler("s3").result()
    rest.delete_checkpoint(trainer.model_id, "sampler_weights/s1").result()
    trainer.save_weights_for_sampler("s3").result()
    assert set(names(rest, trainer.model_id)) == {"sampler_weights/s2", "sampler_weights/s3"}
