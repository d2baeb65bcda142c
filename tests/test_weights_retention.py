"""Published weights across trainer epochs: a restarted trainer publishes version numbers
again (from its checkpoint, or from version 0), and neither its exports nor the dead
trainer's may overwrite or delete the other's while they are among the newest; and
``up --resume`` of a run that has no checkpoint yet; the eval actor across epochs."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.launch.up import prepare_run_dir
from asyncrl.runtime.bus import Bus
from asyncrl.weights.files import (
    KEEP_VERSIONS,
    KeptExports,
    delete_weights,
    export_name,
    link_export,
    manifest_key,
    put_weights,
)
from asyncrl.wire.messages import WeightsUpdated


def export(weights_dir: Path, epoch: int, version: int, when: float) -> Path:
    folder = weights_dir / export_name(epoch, version)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(f"{epoch}/{version}".encode())
    os.utime(folder, (when, when))
    return folder


def test_version_0_of_a_new_epoch_is_kept_and_the_dead_epochs_go_oldest_first(
    tmp_path: Path,
) -> None:
    # the dead trainer published versions 1..6 of epoch 0; its last is the newest on disk
    dead = [export(tmp_path, 0, v, when=1000.0 + v) for v in range(1, 7)]
    kept = KeptExports(tmp_path)
    new = [tmp_path / export_name(1, v) for v in range(3)]
    assert export_name(1, 0) != export_name(0, 0)
    # by name, e1-v000000 would sort first among them; by publication it is the newest
    assert kept.published(new[0]) == dead[:4]
    assert kept.published(new[1]) == [dead[4]]
    assert kept.published(new[2]) == [dead[5]]
    assert kept.order == new and len(kept.order) == KEEP_VERSIONS


def test_a_republished_name_counts_once_as_the_newest(tmp_path: Path) -> None:
    old = [export(tmp_path, 0, v, when=1000.0 + v) for v in (4, 5, 6)]
    kept = KeptExports(tmp_path)
    # a --resume from step 4's checkpoint publishes e0-v000004 again
    assert kept.published(old[0]) == []
    assert kept.order == [old[1], old[2], old[0]]


def test_a_linked_export_is_the_same_bytes_and_outlives_its_source(tmp_path: Path) -> None:
    """A step that both publishes and checkpoints exports once: the checkpoint's ``hf/``
    gets the published export's files, and the export's deletion (it leaves the newest
    few) leaves the checkpoint whole."""
    published = export(tmp_path / "weights", 0, 6, 1.0)
    (published / "config.json").write_text("{}")
    hf = tmp_path / "ckpt" / "hf"
    hf.parent.mkdir()
    link_export(published, hf)
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    weights = published / "model.safetensors"
    assert (hf / "model.safetensors").stat().st_ino == weights.stat().st_ino  # no copy
    shutil.rmtree(published)
    assert (hf / "model.safetensors").read_bytes() == b"0/6"
    assert not (tmp_path / "ckpt" / ".hf.tmp").exists()


async def test_object_store_keys_of_two_epochs_do_not_collide(tmp_path: Path, bus: Bus) -> None:
    bucket = "weights-test"
    a = export(tmp_path, 0, 3, when=1000.0)
    b = export(tmp_path, 1, 3, when=1001.0)
    key_a = await put_weights(bus, bucket, a)
    key_b = await put_weights(bus, bucket, b)
    assert (key_a, key_b) == (manifest_key("e0-v000003"), manifest_key("e1-v000003"))
    await delete_weights(bus, bucket, a)
    buf = io.BytesIO()
    await bus.get_blob(bucket, key_b, buf)
    assert json.loads(buf.getvalue()) == {"files": ["model.safetensors"]}
    buf = io.BytesIO()
    await bus.get_blob(bucket, f"{key_b}/model.safetensors", buf)
    assert buf.getvalue() == b"1/3"
    with pytest.raises(Exception):  # noqa: B017 - whichever not-found error the store raises
        await bus.get_blob(bucket, key_a, io.BytesIO())


def test_resume_without_a_checkpoint_starts_again_and_a_non_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = load_recipe(None, [f"run.dir={tmp_path}", "run.name=early"])
    with pytest.raises(RecipeError, match="not the folder of a run"):
        prepare_run_dir(recipe, resume=True, overwrite=False)
    prepare_run_dir(recipe, resume=False, overwrite=False)  # a run killed at step 1
    (tmp_path / "early" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert prepare_run_dir(recipe, resume=True, overwrite=False) == tmp_path / "early"
    assert "no checkpoint yet" in capsys.readouterr().err
    assert (tmp_path / "early" / "metrics.jsonl").exists()  # the trainer drops its records


async def test_the_eval_receiver_takes_a_new_epochs_version_over_a_rolled_back_one(
    tmp_path: Path, bus: Bus
) -> None:
    """The eval actor's receiver keeps only due versions, yields each in order, and a newer
    trainer epoch wins over a higher version of the lineage it rolled back."""
    from asyncrl.engines.instant import InstantEngine
    from asyncrl.weights.receiver import EngineWeights
    from asyncrl.weights.version import Wanted
    from asyncrl.wire.subjects import Subjects

    receiver = EngineWeights(
        InstantEngine(),
        bus,
        Subjects("t"),
        "eval-0",
        device="cpu",
        want=Wanted(4, 10),
        in_order=True,
    )

    def weights(epoch: int, version: int) -> WeightsUpdated:
        folder = tmp_path / export_name(epoch, version)
        folder.mkdir(exist_ok=True)
        return WeightsUpdated(version=version, kind="dir", location=str(folder), epoch=epoch)

    receiver.announce(weights(0, 8))  # due, not evaluated yet: then the trainer dies
    receiver.announce(weights(1, 0))  # restarted from the initial weights
    async with receiver.receive() as got:
        assert (got.epoch, got.version) == (1, 0)
    receiver.announce(weights(1, 3))  # not due
    receiver.announce(weights(1, 4))
    receiver.announce(weights(0, 8))  # the dead lineage's late word changes nothing
    async with receiver.receive() as got:
        assert (got.epoch, got.version, got.via) == (1, 4, "dir")
        assert got.source == tmp_path / export_name(1, 4)
    # the version not due was never kept; the dead lineage's late word waits, and is
    # passed over at the next call (8 below is epoch 1's)
    assert [(m.epoch, m.version) for m, _ in receiver._pending] == [(0, 8)]
    # due versions that arrive while one is being evaluated are all yielded, oldest first
    receiver.announce(weights(1, 8))
    receiver.announce(weights(1, 10))
    for expected in (8, 10):
        async with receiver.receive() as got:
            assert (got.epoch, got.version) == (1, expected)
