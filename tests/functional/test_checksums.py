"""Checksums recorded at save time catch a flipped byte that every load misses.

Upstream twin: megatron-core (and torch DCP under it) never checks the bytes it reads, so a
byte flipped in a tensor's data on disk loads as a different weight with no error. With the
checksums feature every save (sync, async, fully-parallel) records a checksum of every item;
the plain load checks every item it reads and fails on every rank naming the key, the file,
the byte range and the rank; ``verify_checkpoint`` finds a flip in any item (also one this
rank would not load) on every rank; a checkpoint saved without checksums still loads, unless
the check was asked for (``required=True``): then it fails closed. The whole files a load
reads are covered too: a changed byte in ``.metadata`` or ``common.pt`` fails every rank's
load naming the file (tests/unit/test_checksum_files.py has the single-rank twins).
"""

from __future__ import annotations

import pytest
from checksum_scenarios import checksum_worker

from megatron_ckpt_fixes._dev.testing import run_ranks

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
        assert result["files"] == result["present"] >= 2, result  # .metadata, metadata.json
        assert result["exact"], f"rank {rank}: {run} did not load back exactly"


@pytest.mark.parametrize("run", ["sync", "async", "fully_parallel"])
def test_a_flipped_byte_of_a_large_item_is_caught_on_every_save_path(outcomes, run):
    """The large item's checksum was taken piece by piece as the writer wrote it."""
    file = outcomes[0][run]["flipped_file"]
    errors = [out[run]["flipped"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"], "ranks disagree"
    message = errors[0]["error"]
    assert "ChecksumError" in errors[0]["classes"]
    assert f"'big' chunk at (0,) in {file}" in message, message
    assert message.count("checksum mismatch (recorded xxh3_64") == 1, message


@pytest.mark.parametrize("run", ["sync", "async", "fully_parallel"])
def test_a_flipped_byte_fails_the_plain_load_on_every_rank(outcomes, run):
    """No verify before it: the load checks the bytes it reads (the large item's checksum
    was taken piece by piece as the writer wrote it)."""
    file = outcomes[0][run]["flipped_file"]
    errors = [out[run]["flipped_load"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"], "ranks disagree"
    message = errors[0]["error"]
    assert "1 rank(s) failed:\n  rank 0: ItemChecksumError: 'big' chunk at (0,) in " \
           f"{file} (bytes " in message, message
    assert message.count("checksum mismatch (recorded ") == 1, message
    for error in errors:  # the class a caller of the load already catches
        assert {"CheckpointLoadError", "CheckpointException"} <= set(error["classes"])


def test_a_flipped_byte_loads_silently_upstream(outcomes):
    """The upstream failure: the load reads the flipped byte as data, no error."""
    assert outcomes[0]["corrupt"]["upstream_load_exact"]  # rank 0's chunk is intact
    assert not outcomes[1]["corrupt"]["upstream_load_exact"]


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


def test_the_plain_load_names_the_flipped_byte_on_every_rank(outcomes):
    file = outcomes[0]["flipped_file"]
    errors = [out["corrupt"]["patched_load"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"], "ranks disagree"
    assert f"rank 1: ItemChecksumError: 'w' chunk at ({4}, 0) in {file} (bytes " \
           in errors[0]["error"], errors[0]
    assert "rank 0" not in errors[0]["error"]  # rank 0's items are intact


def test_a_checkpoint_without_checksums_loads(outcomes):
    for out in outcomes:
        assert not out["without"]["sidecar"]
        assert out["without"]["status"] == "absent" and out["without"]["exact"]


def test_a_checkpoint_without_checksums_fails_a_check_that_was_asked_for(outcomes):
    errors = [out["without"]["required"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"] and "ChecksumError" in errors[0]["classes"]
    assert "rank 0: absent (.checksums.json missing: saved without the checksums feature); " \
           "the check was asked for" in errors[0]["error"], errors[0]


@pytest.mark.parametrize("name", [".metadata", "common.pt"])
def test_a_changed_byte_in_a_whole_file_fails_every_rank_naming_it(outcomes, name):
    """Before the file is parsed: the same one-line cause as an item's, on every rank."""
    if f"changed {name}" not in outcomes[0]:
        pytest.skip(f"this megatron-core writes no {name}")
    errors = [out[f"changed {name}"] for out in outcomes]
    assert errors[0]["error"] == errors[1]["error"], "ranks disagree"
    message = errors[0]["error"]
    for rank in range(WS):
        assert f"rank {rank}: FileChecksumError: {name} (bytes 0..{errors[0]['size']}): " \
               "checksum mismatch (recorded xxh3_64 " in message, message
    for error in errors:
        assert "CheckpointLoadError" in error["classes"]
