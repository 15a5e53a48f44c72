"""Checksums recorded at save time catch a flipped byte that every load misses.

Upstream twin: megatron-core (and torch DCP under it) never checks the bytes it reads, so a
byte flipped in a tensor's data on disk loads as a different weight with no error, with plain
upstream and with the fixes alike. With the checksums feature every save (sync, async,
fully-parallel) records a checksum (xxh3_64) of every item, ``verify_checkpoint`` finds a
flip in any of them on every rank with the key and the file, and a checkpoint saved without
checksums still loads.
"""

from __future__ import annotations

import pytest
from checksum_scenarios import checksum_worker

from megatron_ckpt_fixes.testing import run_ranks

WS = 2


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("checksums")
    return [r.value for r in run_ranks(checksum_worker, WS, str(root), timeout_s=400)]


@pytest.mark.parametrize("run", ["sync", "async", "fully_parallel"])
def test_every_saved_item_is_checksummed_and_matches(outcomes, run):
    for rank, out in enumerate(outcomes):
        result = out[run]
        assert result.get("error") is None, f"rank {rank}: {result}"
        assert result["sidecar"] and result["status"] == "verified", result
        assert result["unrecorded"] == 0 and result["checked"] == result["items"], result
        assert result["exact"], f"rank {rank}: {run} did not load back exactly"


@pytest.mark.parametrize("run", ["sync", "async", "fully_parallel"])
def test_a_flipped_byte_of_a_large_item_is_caught_on_every_save_path(outcomes, run):
    """The large item's checksum was taken by the writer's helper thread, beside the I/O."""
    file = outcomes[0][run]["flipped_file"]
    errors = [out[run]["flipped"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"], "ranks disagree"
    message = errors[0]["error"]
    assert "ChecksumError" in errors[0]["classes"]
    assert f"'big' chunk at (0,) in {file}" in message, message
    assert message.count("checksum mismatch (recorded xxh3_64") == 1, message


def test_a_flipped_byte_loads_silently_upstream(outcomes):
    """The upstream failure: the load reads the flipped byte as data, no error."""
    assert outcomes[0]["corrupt"]["upstream_load_exact"]  # rank 0's chunk is intact
    assert not outcomes[1]["corrupt"]["upstream_load_exact"]
    assert not outcomes[1]["corrupt"]["patched_load_exact"]  # the load itself checks nothing


def test_a_flipped_byte_is_named_on_every_rank(outcomes):
    file = outcomes[0]["flipped_file"]
    errors = [out["corrupt"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"], "ranks disagree"
    message = errors[0]["error"]
    assert f"'w' chunk at ({4}, 0) in {file}" in message, message
    assert "checksum mismatch (recorded xxh3_64" in message
    assert message.count("checksum mismatch") == 1, message  # nothing else is reported
    for error in errors:
        assert {"ChecksumError", "CheckpointingException",
                "MegatronCkptFixesError"} <= set(error["classes"])


def test_a_checkpoint_without_checksums_loads(outcomes):
    for out in outcomes:
        assert not out["without"]["sidecar"]
        assert out["without"]["status"] == "absent" and out["without"]["exact"]
