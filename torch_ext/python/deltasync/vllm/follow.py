"""Following a store on the engine's own time: the workers brought to each new version between
two engine steps, with no trainer call.

    llm.init_weight_transfer_engine({"init_info": {"store": URL, "follow": True,
                                                   "poll_seconds": 1.0, "max_staleness_seconds": 30}})

(or the same JSON to /init_weight_transfer_engine of `vllm serve`). It runs in vLLM's engine
core, the one process that sees every step:

- a daemon thread asks the store for its newest version every `poll_seconds`, jittered by +-50% (a conditional GET
  of LATEST, StoreWatcher) and, when one is newer than the served one, wakes an idle engine
  core (a WAKEUP on its input queue) so an engine with no requests follows too;
- between two steps (before a step, and after each client request), the engine core brings every
  worker to the newest version seen through vLLM's own weight-update session
  (start_weight_update / update_weights / finish_weight_update: a session a user has open is
  never interleaved, the follower waits for its end), labels the weights with it
  (set_weight_version: every output's `weight_versions` spans and the /weight_info route report
  it), and the plugin resets the prefix cache as after any deltasync update (plugin.py);
- staleness is the time since the oldest version newer than the served one was first seen.
  With `max_staleness_seconds` the engine schedules no step once that bound is passed (requests
  wait: no token comes from weights staler than the bound) and retries every poll until the
  update succeeds. Without it a failing update is retried every poll while the engine serves
  the last version it reached.

A failed update leaves each worker at a consistent version (the mapped receiver rolls back
every rank together); the follower asks the workers which one and labels the weights with it.
An anchor that fails after its first write leaves the weights torn, at no version (plugin.py
labels them "broken"): then no step is scheduled, whatever the bound, and the update is retried
every poll until an anchor is written whole (status()["broken"] says why).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass

from .._library import native
from . import compat

logger = logging.getLogger("deltasync.vllm.follow")


@dataclass(frozen=True)
class FollowOptions:
    store: str
    poll_seconds: float = 1.0
    max_staleness_seconds: float | None = None

    @staticmethod
    def from_init_info(init_info: dict) -> "FollowOptions | None":
        """The options of an init_info that asks to follow; None when it does not. A bad value
        is refused (ValueError, one line) before anything starts."""
        follow = init_info.get("follow", False)
        if follow in (False, None):
            return None
        if follow is not True:
            raise ValueError(f"deltasync: init_info follow={follow!r}: give true or false")
        store = init_info.get("store")
        poll = _seconds(init_info, "poll_seconds", 1.0)
        bound = _seconds(init_info, "max_staleness_seconds", None)
        if poll is None or poll <= 0:
            raise ValueError(f"deltasync: init_info poll_seconds={init_info.get('poll_seconds')!r}: give seconds > 0")
        if bound is not None and bound <= 0:
            raise ValueError(f"deltasync: init_info max_staleness_seconds={bound!r}: give seconds > 0, or leave it out")
        return FollowOptions(store, poll, bound)


def _seconds(init_info: dict, key: str, default):
    value = init_info.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"deltasync: init_info {key}={value!r}: give a number of seconds")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"deltasync: init_info {key}={value!r}: give a number of seconds") from None


# Followers whose polling thread may still run, stopped before the interpreter finalizes: a daemon
# thread caught inside the native poll then (the GIL released while it waits on the store) is
# ended by the interpreter as it takes the GIL back, by an unwind through C++ that cannot be
# unwound, and the process aborts ("terminate called without an active exception"). atexit
# handlers run before daemon threads are ended, and the poll in flight finishes meanwhile.
_live_followers: "weakref.WeakSet[StoreFollower]" = weakref.WeakSet()


@atexit.register
def _stop_followers_at_exit() -> None:
    for follower in list(_live_followers):
        follower.stop(timeout=30)


class StoreFollower:
    """One engine core's follower. `between_steps()` is called by the engine core's own thread
    only (plugin.py); the polling thread only reads the store and records what it saw."""

    def __init__(self, core, options: FollowOptions, served: int | None = None):
        self.core = core
        self.options = options
        self.watcher = native().StoreWatcher(options.store)
        self.served = served                       # version every worker holds (None: not one yet)
        self.updates = 0                           # versions brought in by the follower
        self.last_update: dict | None = None       # the last one: version, seconds, staleness
        self.last_error: str | None = None
        self._seen: list[tuple[int, float]] = []   # (newest version, when first seen), ascending
        self._lock = threading.Lock()
        self._next_attempt = 0.0
        self._stalled = False
        self.updating = False                      # inside _update (its own update_weights call)
        self._holding = False                      # scheduling held for batches in flight to finish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="deltasync-follow", daemon=True)
        _live_followers.add(self)
        self._thread.start()

    # -- the polling thread ------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                newest = self.watcher.newest()
            except Exception as e:  # noqa: BLE001 - a store hiccup: logged, polled again
                self._note_error(f"deltasync: following {self.options.store}: polling failed: {e}")
                newest = None
            if newest is not None:
                with self._lock:
                    if not self._seen or newest > self._seen[-1][0]:
                        self._seen.append((newest, time.monotonic()))
                # Behind: wake the engine core every poll (a new version, or a failed update's retry).
                served = self.served
                if served is None or newest > served:
                    self._wake()
            self._stop.wait(self.watcher.next_delay(self.options.poll_seconds))

    def _wake(self) -> None:
        compat.wake(self.core)

    # -- the engine core's thread ------------------------------------------------------------

    def newest_seen(self) -> int | None:
        with self._lock:
            return self._seen[-1][0] if self._seen else None

    def staleness(self, now: float | None = None) -> float:
        """Seconds since the oldest version newer than the served one was first seen (0: up to date)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for version, seen_at in self._seen:
                if self.served is None or version > self.served:
                    return max(0.0, now - seen_at)
        return 0.0

    def between_steps(self, idle: bool = False) -> bool:
        """Brings the workers to the newest version seen when one is due. Returns whether the
        engine may step (False: the served weights are staler than the bound)."""
        target = self.newest_seen()
        if target is None or (self.served is not None and target <= self.served):
            self._stalled = False  # caught up (a user's update may have done it)
            return True
        now = time.monotonic()
        if now >= self._next_attempt:
            if compat.batches_in_flight(self.core):
                # Async scheduling / pipeline parallelism: batches scheduled on the old weights
                # are still executing. No new work is scheduled until they are done (this step
                # and the next finish them); the update comes at the first step with none left.
                self._hold_scheduling()
                return True
            self._update(target)
            self._release_scheduling()
        bound = self.options.max_staleness_seconds
        broken = self.broken()
        over = broken is not None or (bound is not None and self.staleness() > bound)
        if broken is not None and not self._stalled:
            logger.error("deltasync: following %s: the served weights are torn (%s): no steps until version %d is "
                         "served", self.options.store, broken, target)
        elif over and not self._stalled:
            logger.warning("deltasync: following %s: serving version %s, %.1f s behind version %d (bound %.1f s): "
                           "no steps until it is served; last error: %s", self.options.store, self.served,
                           self.staleness(), target, bound, self.last_error)
        self._stalled = over
        if over and not idle:
            # The engine loops straight back into step(): wait for the next attempt here.
            time.sleep(max(0.0, min(self.options.poll_seconds, self._next_attempt - time.monotonic())))
        return not over

    def after_external_update(self) -> None:
        """A user's update_weights went through the same workers: learn where they are now."""
        self.served = self._workers_version()

    def broken(self) -> str | None:
        """Why the served weights are torn (a failed anchor wrote part of them; plugin.py)."""
        from .plugin import broken_reason

        return broken_reason(self.core)

    def status(self) -> dict:
        return {"store": self.options.store, "served": self.served, "newest_seen": self.newest_seen(),
                "staleness_seconds": self.staleness(), "stalled": self._stalled, "updates": self.updates,
                "last_update": self.last_update, "last_error": self.last_error, "broken": self.broken()}

    def stop(self, timeout: float = 5) -> None:
        """Ends the polling thread (a poll in flight finishes first, for up to `timeout` s)."""
        self._release_scheduling()
        self._stop.set()
        self._thread.join(timeout=timeout)
        _live_followers.discard(self)

    def _hold_scheduling(self) -> None:
        if not self._holding:
            self._holding = compat.hold_scheduling(self.core)

    def _release_scheduling(self) -> None:
        if self._holding:
            compat.release_scheduling(self.core)
            self._holding = False

    def _update(self, target: int) -> None:
        self.updating = True
        try:
            self._update_to(target)
        finally:
            self.updating = False

    def _update_to(self, target: int) -> None:
        core = self.core
        if any(state["updating"] for state in core.collective_rpc("deltasync_state")):
            # A user's weight-update session is open (a start vLLM's workers would refuse): wait for its end.
            self._retry_later(f"deltasync: following {self.options.store}: version {target} waits for an open "
                              "weight-update session to finish")
            return
        staleness = self.staleness()
        started = time.perf_counter()
        core.collective_rpc("start_weight_update")
        try:
            core.collective_rpc("update_weights", kwargs={"update_info": {"version": target}})
        except Exception as e:  # noqa: BLE001 - every rank rolled back; the session is closed (plugin.py)
            before = self.served
            self.served = self._workers_version()
            if self.served is not None and self.served != before:
                core.set_weight_version(str(self.served))
            self._retry_later(f"deltasync: following {self.options.store}: version {target} failed "
                              f"(serving {self.served}): {e}")
            return
        core.collective_rpc("finish_weight_update")
        self.served = target
        core.set_weight_version(str(target))
        self.updates += 1
        self.last_error = None
        self._next_attempt = 0.0
        with self._lock:
            self._seen = [(v, t) for v, t in self._seen if v > target]
        self.last_update = {"version": target, "seconds": time.perf_counter() - started, "staleness_seconds": staleness,
                            "served_at": time.monotonic()}
        logger.info("deltasync: following %s: serving version %d (%.1f ms, %.2f s after it was seen)",
                    self.options.store, target, 1e3 * self.last_update["seconds"], staleness)

    def _workers_version(self) -> int | None:
        versions = [state["version"] for state in self.core.collective_rpc("deltasync_state")]
        return versions[0] if versions and all(v == versions[0] for v in versions) else None

    def _retry_later(self, message: str) -> None:
        self._note_error(message)
        self._next_attempt = time.monotonic() + self.options.poll_seconds

    def _note_error(self, message: str) -> None:
        if message != self.last_error:
            logger.warning("%s", message)
        self.last_error = message
