"""A `vllm serve` process as the engine a TRL sync drives, through vLLM's own HTTP routes (no
NCCL, no connection to the trainer's tensors): the server's workers read every version from
the store themselves, through deltasync's native weight-transfer backend.

    vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'   # VLLM_SERVER_DEV_MODE=1
    engine = VLLMServerEngine("http://127.0.0.1:8000", store="s3://bucket/run")
    trainer = GRPOTrainer(..., callbacks=[DeltaSyncCallback("s3://bucket/run", engine=engine)])

The routes (vLLM >= 0.26, registered only with VLLM_SERVER_DEV_MODE=1): /init_weight_transfer_engine
once, at the first update (the store must hold that version: set-up reads its anchor's headers);
then per version POST /pause?mode=..., /start_weight_update, /update_weights, /finish_weight_update
(which names the version GET /weight_info reports), /resume. `store` is the URL as the server
sees it, which may differ from the trainer's (another mount, another endpoint). Or, with
follow(), the server follows the store by itself and the trainer only publishes. Standard library
only: the trainer's environment needs nothing of vLLM's."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from .._library import native


class VLLMServerError(RuntimeError):
    """A route of the vLLM server answered with an error (or not at all)."""


class VLLMServerEngine:
    def __init__(self, url: str, store: str, pause_mode: str = "keep", timeout: float = 600.0):
        """pause_mode: what /pause does with requests in flight -- "keep" (frozen, they continue on
        the new weights after /resume; their KV blocks are recomputed, the deltasync plugin resets
        the cache after each update), "wait" (finish them first) or "abort"."""
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"deltasync.trl.VLLMServerEngine: pause_mode {pause_mode!r}: use keep, wait or abort")
        self.url = url.rstrip("/")
        self.store = store
        self.pause_mode = pause_mode
        self.timeout = timeout
        self.connected = False
        self.served_version: int | None = None

    # ---- InferenceEngine --------------------------------------------------------------------------

    def pause(self) -> None:
        self.post(f"/pause?mode={self.pause_mode}")

    def update(self, version: int) -> int:
        if not self.connected:
            # Inside the pause: learning the index maps swaps the runtime tensors for integer
            # twins for a moment (backend.py, index_map.py).
            self.post("/init_weight_transfer_engine", {"init_info": {"store": self.store}})
            self.connected = True
        self.post("/start_weight_update")
        self.post("/update_weights", {"update_info": {"version": int(version)}})
        self.post("/finish_weight_update", {"weight_version": str(int(version))})
        self.served_version = self.weight_version()
        if self.served_version != version:
            raise VLLMServerError(f"deltasync.trl.VLLMServerEngine: {self.url} serves version {self.served_version} "
                                  f"after updating to {version}")
        return self.served_version

    def resume(self) -> None:
        self.post("/resume")

    def close(self) -> None:
        # The server outlives the trainer: it keeps serving, and stays connected to the store (a
        # later trainer's engine connects again); disconnect() drops the connection.
        pass

    def follow(self, poll_seconds: float = 1.0, max_staleness_seconds: float | None = None) -> None:
        """Makes the server follow the store on its own time (deltasync/vllm/follow.py): it polls
        the store every `poll_seconds` and brings its workers to each new version between engine
        steps; with `max_staleness_seconds` it stops generating once it is that far behind a
        version it has seen. The trainer then only publishes (DeltaSync(store, engine=None));
        GET /weight_info (weight_version()) reports what the server serves."""
        info = {"store": self.store, "follow": True, "poll_seconds": poll_seconds}
        if max_staleness_seconds is not None:
            info["max_staleness_seconds"] = max_staleness_seconds
        self.post("/init_weight_transfer_engine", {"init_info": info})
        self.connected = True

    def disconnect(self) -> None:
        """Drops the workers' store connection (POST /shutdown_weight_transfer_engine)."""
        self.post("/shutdown_weight_transfer_engine")
        self.connected = False

    # ---- the server's state -------------------------------------------------------------------------

    def weight_version(self) -> int | None:
        """The version the server reports (GET /weight_info); None before the first update."""
        value = self.get("/weight_info").get("weight_version")
        # Not a version ("broken" after a torn anchor, none yet): None. The C++ number rule.
        return native().try_parse_decimal(value) if isinstance(value, str) else None

    def is_paused(self) -> bool:
        return bool(self.get("/is_paused").get("is_paused"))

    def collective_rpc(self, method: str, *args: str) -> list:
        """Calls `method` on every worker (POST /collective_rpc); vLLM passes only string arguments."""
        return self.post("/collective_rpc", {"method": method, "args": list(args)}).get("results", [])

    def audit(self, tensors: dict, checkpoint_dir: str = "") -> dict:
        """The served weights against `tensors` ({Hugging Face name: tensor}, the trainer's),
        checked by the server's workers (deltasync.vllm.audit, the server started with
        --worker-extension-cls deltasync.vllm.audit.ServedWeightsAudit): digests of every tensor,
        and, with `checkpoint_dir` (those tensors saved as a checkpoint), vLLM's own loader on
        them compared bit for bit with every runtime parameter. TP=1: the one worker's result."""
        from .. import ops

        digests = ops.digest([t.detach() for t in tensors.values()]).tolist()
        results = self.collective_rpc("deltasync_audit", json.dumps(dict(zip(tensors, map(str, digests)))),
                                      str(checkpoint_dir))
        if len(results) != 1:
            raise VLLMServerError(f"deltasync.trl.VLLMServerEngine.audit: {len(results)} workers answered; "
                                  "the audit compares one (TP=1)")
        return results[0]

    # ---- HTTP -------------------------------------------------------------------------------------

    def get(self, route: str) -> dict:
        return self._request("GET", route, None)

    def post(self, route: str, body: dict | None = None) -> dict:
        return self._request("POST", route, body)

    def _request(self, method: str, route: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip().replace("\n", " ")[:300]
            raise VLLMServerError(f"deltasync.trl.VLLMServerEngine: {method} {self.url}{route}: HTTP {e.code}: "
                                  f"{detail or e.reason} (the server's log has the cause)") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise VLLMServerError(f"deltasync.trl.VLLMServerEngine: {method} {self.url}{route}: {reason}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"text": text}
