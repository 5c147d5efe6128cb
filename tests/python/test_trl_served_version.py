"""deltasync.trl.async_rollout.served_version: the version a rollout is tagged with, from the
`weight_versions` spans vLLM's /inference/v1/generate returns with each choice."""
from deltasync.trl.async_rollout import served_version


def span(version, start, end):
    return {"version": version, "start": start, "end": end}


def test_a_completion_spanning_two_versions_is_tagged_with_the_older():
    assert served_version([span("3", 0, 2), span("4", 2, 8)]) == 3
    assert served_version([span("7", 0, 5)]) == 7


def test_empty_spans_sampled_nothing():
    assert served_version([span("2", 0, 0), span("5", 0, 4)]) == 5


def test_no_deltasync_version_is_none():
    assert served_version(None) is None and served_version([]) is None
    assert served_version([span("default", 0, 3)]) is None  # the weights vLLM loaded itself
    assert served_version([span("default", 0, 1), span("4", 1, 3)]) is None
