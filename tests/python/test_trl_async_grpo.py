"""deltasync.trl.DeltaWeightTransfer as the weight_transfer of TRL's experimental
AsyncGRPOTrainer (TRL 1.16 from PyPI, CPU). Its training step needs FlashAttention-3 kernels
(GPU only), so the optimizer steps here are plain AdamW steps on the trainer's own model; the
syncs are the trainer's own: AsyncGRPOTrainer._sync_weight(), which its training loop calls
after every optimizer step (pause, send_weights(trainer's parameter stream), resume, version
bump). A second copy of the model, receiving only through the store, is bit-identical to the
trainer after every sync. With a server that follows the store on its own time, the trainer's
sync is the delta's staging only: it waits neither for the upload nor for the server."""
import queue
import threading

import torch
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

import deltasync
import trl_tiny
from deltasync.trl import DeltaWeightTransfer, SubscriberEngine
from fault_proxy import FaultProxy
from test_http_store import DavServer

STEPS = 3


class RecordingRolloutWorker:
    """TRL's RolloutWorkerProtocol with nothing to generate: AsyncGRPOTrainer needs a worker to be
    built, and this one records the policy versions the trainer announces after each sync."""

    def __init__(self):
        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()
        self.announced = []

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        self.announced.append(model_version)

    def check_health(self, stale_after_s):
        pass


class CheckedEngine(SubscriberEngine):
    """The subscriber engine, checked against the trainer's weights after every update."""

    def __init__(self, receiver, store, trainer_model):
        super().__init__(receiver, store)
        self.receiver, self.trainer_model = receiver, trainer_model
        self.checked = []

    def update(self, version):
        served = super().update(version)
        received = dict(self.receiver.named_parameters())
        differing = [n for n, p in self.trainer_model.named_parameters()
                     if not torch.equal(p.detach().view(torch.int16), received[n].view(torch.int16))]
        assert not differing, f"version {version}: receiver differs in {differing[:3]}"
        self.checked.append(version)
        return served


def test_async_grpo_trains_on_rollouts_from_the_receiver(tmp_path, monkeypatch):
    # TRL 1.16's AsyncGRPOTrainer asks torch.cuda for the device name (for MFU metrics) even on a
    # CPU-only machine; the one test-only patch: no peak FLOPs known, as on an unknown GPU.
    import trl.experimental.async_grpo.async_grpo_trainer as async_grpo_trainer
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    tokenizer = trl_tiny.make_tokenizer()
    model_dir = tmp_path / "tiny-qwen2"  # AsyncGRPOTrainer loads its policy by path
    trl_tiny.make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    receiver = trl_tiny.make_model(tokenizer)
    with torch.no_grad():  # the receiver starts elsewhere: only the store brings it to the trainer's weights
        for p in receiver.parameters():
            p.zero_()
    store = f"file://{tmp_path / 'store'}"
    engine = CheckedEngine(receiver, store, trainer_model=None)  # the trainer's model, once it is built
    # Only the first version anchors: this tiny model's deltas are about half its size, so the
    # default size rule (anchor_share) would anchor every other step.
    transfer = DeltaWeightTransfer(store, engine=engine, anchor_every=0, anchor_share=1e9)
    worker = RecordingRolloutWorker()
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=6, max_steps=STEPS, report_to="none", save_strategy="no",
                           use_cpu=True, weight_sync_steps=1, dtype="bfloat16")
    trainer = AsyncGRPOTrainer(model=str(model_dir), args=args, reward_funcs=trl_tiny.reward_letter_a,
                               train_dataset=trl_tiny.prompts_dataset(), processing_class=tokenizer,
                               weight_transfer=transfer, rollout_worker=worker)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    engine.trainer_model = policy
    transfer.init_weight_transfer()
    trainer._sync_weight()  # the cold sync of train begin
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in policy.parameters())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        trainer._sync_weight()
    transfer.destroy()

    # Store versions are the policy versions the trainer announces: 1 (an anchor), then one per step.
    assert engine.checked == worker.announced == list(range(1, STEPS + 2)) and trainer.model_version == STEPS + 1
    reports = transfer.reports
    assert [r.version for r in reports] == engine.checked and reports[0].anchor
    assert all(r.pause_seconds is not None and r.served_version == r.version for r in reports)
    assert not engine.paused
    assert all(0 < r.changed_elements < r.total_elements for r in reports[1:])
    assert all(0 < r.delta_bytes < r.model_bytes for r in reports[1:])


class FollowingServer:
    """What DeltaWeightTransfer sees of a VLLMServerEngine that follows the store: follow() at the
    cold sync, then weight_version() until it serves that version. Every call is recorded; any
    other route (pause, update, resume, ...) fails the test."""

    url, store, timeout = "http://following-server.invalid", "the store", 30.0

    def __init__(self):
        self.calls, self.connected = [], False

    def follow(self, poll_seconds):
        self.calls.append("follow")
        self.connected = True

    def weight_version(self):
        self.calls.append("weight_version")
        return 1  # serving the cold sync's version

    def __getattr__(self, name):
        raise AssertionError(f"the trainer's sync called the following server's {name}")


def make_async_trainer(tmp_path, tokenizer, transfer):
    import trl.experimental.async_grpo.async_grpo_trainer as async_grpo_trainer
    model_dir = tmp_path / "tiny-qwen2"
    trl_tiny.make_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=6, max_steps=STEPS, report_to="none", save_strategy="no",
                           use_cpu=True, weight_sync_steps=1, dtype="bfloat16")
    saved = async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None  # as in the test above
    try:
        return AsyncGRPOTrainer(model=str(model_dir), args=args, reward_funcs=trl_tiny.reward_letter_a,
                                train_dataset=trl_tiny.prompts_dataset(), processing_class=tokenizer,
                                weight_transfer=transfer, rollout_worker=RecordingRolloutWorker())
    finally:
        async_grpo_trainer.get_peak_flops_per_device = saved


def test_a_sync_with_a_following_server_waits_for_neither_the_upload_nor_the_server(tmp_path, monkeypatch):
    """TRL's _sync_weight() (pause, send_weights, resume, version bump) with the server following
    the store: it returns while the delta's upload is held at the store (the version not yet
    visible) and without a call to the server; the version becomes visible once the upload may
    go on, and a subscriber reads the trainer's weights from it, bit for bit."""
    monkeypatch.setenv("DELTASYNC_STORE_RETRY_BASE_MS", "1")
    dav = DavServer()
    proxy = FaultProxy(*dav.httpd.server_address).start()
    gate = threading.Event()
    try:
        store = f"{proxy.url}/weights/run-1"
        tokenizer = trl_tiny.make_tokenizer()
        server = FollowingServer()
        transfer = DeltaWeightTransfer(store, follower=server, follow_poll_seconds=0.01, anchor_every=0,
                                       anchor_share=1e9)
        trainer = make_async_trainer(tmp_path, tokenizer, transfer)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        trainer._sync_weight()  # the cold sync: version 1 visible, then the server follows and serves it
        publisher = transfer.sync.publisher
        assert server.calls[0] == "follow" and "weight_version" in server.calls
        assert publisher.state()["last_version"] == 1
        calls_after_cold_sync = list(server.calls)

        stalled = proxy.add("gate", times=10**9, method="PUT", event=gate)  # every upload waits at the store
        with torch.no_grad():
            for p in policy.parameters():
                p.view(torch.int16).add_(1)  # every element moves by one ulp
        trainer._sync_weight()
        # Returned with version 2 staged and its upload still held: not visible, the server not asked.
        assert stalled.hit.wait(30)
        report = transfer.reports[-1]
        assert report.version == 2 and report.changed_elements == report.total_elements
        assert publisher.state()["last_version"] == 1 and not report.visible
        assert server.calls == calls_after_cold_sync
        assert trainer.model_version == 2 and trainer.rollout_worker.announced == [1, 2]

        gate.set()
        transfer.destroy()  # train end: flushes
        assert publisher.state()["last_version"] == 2
        receiver = trl_tiny.make_model(tokenizer, seed=1)
        assert deltasync.DeltaSubscriber(receiver, store=store).update() == 2
        received = dict(receiver.named_parameters())
        differing = [n for n, p in policy.named_parameters()
                     if not torch.equal(p.detach().view(torch.int16), received[n].detach().view(torch.int16))]
        assert not differing, differing[:3]
    finally:
        gate.set()
        proxy.stop()
        dav.stop()
