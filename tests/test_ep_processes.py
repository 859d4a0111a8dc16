"""The expert-parallel process harness (tests/ep_worker.py) on CPU devices: one process driving two devices and one
process per device over `jax.distributed` (gloo collectives), bit-exact against the oracle, and a killed process
ending the other with the coordination service's diagnostic instead of a hang. The GPU runs of the same harness are
in tests/test_multigpu.py."""

import re

import ep_worker
import pytest


@pytest.mark.parametrize("per_process", [False, True], ids=["one-process", "process-per-device"])
def test_ranks_on_cpu_devices_are_exact(per_process):
  """Rank 1's process also starts its first step a second late (``--first-call-skew``, the GPU drill of
  tests/test_fused.py): the collectives wait for it; then ``--release`` (`gm.release_fused_workspaces`, collective:
  no group to release with the collective transport) and a fresh trace, exact again."""
  results = ep_worker.launch(2, "--steps", "3", "--first-call-skew", "1", "--release", per_process=per_process,
                             cpu=True, deadline_s=180)
  for i, (rc, text) in enumerate(results):
    assert rc == 0 and "OK 3 steps" in text, f"worker {i} (rc {rc}):\n{ep_worker.tail(text)}"
    assert len(re.findall(r"step \d bit-exact", text)) == 3, ep_worker.tail(text)
    assert "released no groups" in text and "a new trace bit-exact" in text, ep_worker.tail(text)


def test_a_killed_process_ends_the_other_with_a_diagnostic():
  results = ep_worker.launch(2, "--steps", "40", "--die-at", "2", "--fault-rank", "1", "--heartbeat", "5",
                             per_process=True, cpu=True, deadline_s=120)
  (rc0, text0), (rc1, text1) = results
  assert rc1 == 17 and "exiting abruptly at step 2" in text1, ep_worker.tail(text1)
  # (the worker's success line, not any "OK": a traceback's paths may hold one, as a mktemp clone's /tmp/tmp.*OK* did)
  assert rc0 != 0 and not re.search(r"^OK \d+ steps", text0, re.M), ep_worker.tail(text0)
  assert re.search(r"heartbeat timeout|another task died|unhealthy", text0), ep_worker.tail(text0)


def test_processes_exchange_bytes_through_the_distributed_store():
  """`sharding._peers.exchange` (the fused transport's IPC-handle exchange): every process gets every process's
  bytes, in process order, over several exchanges."""
  results = ep_worker.launch(2, "--exchange", "5", per_process=True, cpu=True, deadline_s=120)
  for i, (rc, text) in enumerate(results):
    assert rc == 0 and "EXCHANGE OK 5 x 2 processes" in text, f"worker {i} (rc {rc}):\n{ep_worker.tail(text)}"


def test_an_exchange_a_process_never_joins_times_out_naming_it():
  results = ep_worker.launch(2, "--exchange", "1", "--die-at", "0", "--fault-rank", "1", "--exchange-timeout-ms",
                             "2000", "--heartbeat", "30", per_process=True, cpu=True, deadline_s=120)
  rc0, text0 = results[0]
  assert rc0 != 0 and re.search(r"TimeoutError: exchange: process 1 did not publish 'test0' within 2000 ms "
                                r"\(this is process 0 of 2\)", text0), ep_worker.tail(text0)


def test_a_single_process_exchange_returns_its_own_bytes():
  from gcmoe_jax.sharding import _peers

  assert _peers.exchange("single-process-test", b"\x00\x01") == [b"\x00\x01"]
  with pytest.raises(ValueError, match="name 'single-process-test' was already exchanged in this process"):
    _peers.exchange("single-process-test", b"")
  with pytest.raises(TypeError, match="payload must be bytes, got str"):
    _peers.exchange("other", "text")
  with pytest.raises(ValueError, match="name must be a non-empty str without '/', got 'a/b'"):
    _peers.exchange("a/b", b"")
