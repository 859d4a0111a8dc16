"""The expert-parallel process harness (tests/ep_worker.py) on CPU devices: one process driving two devices and one
process per device over `jax.distributed` (gloo collectives), bit-exact against the oracle, and a killed process
ending the other with the coordination service's diagnostic instead of a hang. The GPU runs of the same harness are
in tests/test_multigpu.py."""

import re

import ep_worker
import pytest


@pytest.mark.parametrize("per_process", [False, True], ids=["one-process", "process-per-device"])
def test_ranks_on_cpu_devices_are_exact(per_process):
  results = ep_worker.launch(2, "--steps", "3", per_process=per_process, cpu=True, deadline_s=180)
  for i, (rc, text) in enumerate(results):
    assert rc == 0 and "OK 3 steps" in text, f"worker {i} (rc {rc}):\n{ep_worker.tail(text)}"
    assert len(re.findall(r"step \d bit-exact", text)) == 3, ep_worker.tail(text)


def test_a_killed_process_ends_the_other_with_a_diagnostic():
  results = ep_worker.launch(2, "--steps", "40", "--die-at", "2", "--fault-rank", "1", "--heartbeat", "5",
                             per_process=True, cpu=True, deadline_s=120)
  (rc0, text0), (rc1, text1) = results
  assert rc1 == 17 and "exiting abruptly at step 2" in text1, ep_worker.tail(text1)
  assert rc0 != 0 and "OK" not in text0, ep_worker.tail(text0)
  assert re.search(r"heartbeat timeout|another task died|unhealthy", text0), ep_worker.tail(text0)
