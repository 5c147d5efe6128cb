"""DeltaPublisher(resume=True): a trainer restarted with nothing but the store (killed mid-publish,
its local files gone) continues from the store's newest version."""
import torch

import deltasync


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16), "b": torch.randn(100, generator=g).to(torch.bfloat16)}


def _step(model, v):
    g = torch.Generator().manual_seed(100 + v)
    with torch.no_grad():
        for t in model.values():
            bits = t.view(-1).view(torch.int16)
            pick = torch.randint(0, bits.numel(), (20,), generator=g)
            bits[pick] += 1


def test_an_empty_store_starts_fresh(tmp_path):
    with deltasync.DeltaPublisher(_model(0), store=f"file://{tmp_path}", resume=True) as pub:
        assert pub.resumed_version is None
        assert pub.publish(0).anchor


def test_a_restarted_publisher_continues_the_store_with_deltas(tmp_path):
    store = f"file://{tmp_path}"
    trainer = _model(0)
    # anchor_share=0: only the anchor_every schedule decides (this model is 4 KB, so its deltas'
    # headers alone pass the default share of the model within three versions).
    with deltasync.DeltaPublisher(trainer, store=store, anchor_every=5, anchor_share=0) as pub:
        for v in range(4):
            if v:
                _step(trainer, v)
            pub.publish(v)
    restarted = _model(1)  # the new process's own initial weights: overwritten by the store's
    with deltasync.DeltaPublisher(restarted, store=store, anchor_every=5, anchor_share=0, resume=True) as pub:
        assert pub.resumed_version == 3
        assert all(torch.equal(restarted[k].view(torch.int16), trainer[k].view(torch.int16)) for k in trainer)
        for v in (4, 5):
            _step(trainer, v)
            _step(restarted, v)
            pub.publish(v)
        pub.flush()
        stats = {s.version: s for s in pub.stats}
        assert not stats[4].anchor and stats[4].base_version == 3  # a delta from the store's version
        assert stats[5].anchor  # the anchor schedule continues from version 0
    follower = {k: torch.zeros_like(t) for k, t in trainer.items()}
    sub = deltasync.DeltaSubscriber(follower, store=store)
    assert sub.update() == 5
    assert all(torch.equal(follower[k].view(torch.int16), trainer[k].view(torch.int16)) for k in trainer)


def test_resume_refuses_a_model_that_is_not_the_published_one(tmp_path):
    store = f"file://{tmp_path}"
    with deltasync.DeltaPublisher(_model(0), store=store) as pub:
        pub.publish(0)
    other = {"a": torch.zeros(64, 32, dtype=torch.bfloat16), "c": torch.zeros(100, dtype=torch.bfloat16)}
    try:
        deltasync.DeltaPublisher(other, store=store, resume=True)
    except deltasync.errors.DeltaSyncError as e:
        assert "does not match" in str(e)
    else:
        raise AssertionError("resume accepted another model's tensors")
    assert torch.equal(other["a"], torch.zeros(64, 32, dtype=torch.bfloat16))  # nothing written
