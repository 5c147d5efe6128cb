"""The disaggregated loop's environment (scripts/disaggregated/wordle_server.py) in a process of its
own, played over HTTP through the trainer-side WordleEnv (TRL's environment_factory contract):
games to the end, feedback by Wordle's rule for repeated letters, and bad requests answered with
one clear error while the server goes on serving the other episodes."""
import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "disaggregated"))
import wordle_env  # noqa: E402
from wordle_server import feedback  # noqa: E402


@pytest.fixture
def server(tmp_path):
    proc, url = wordle_env.start(tmp_path / "wordle.log", words="crane")  # one word: the games are known
    yield url
    assert proc.poll() is None, "the environment server exited"
    proc.terminate()
    proc.wait(10)


def test_feedback_marks_repeated_letters_as_wordle_does():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("crane", "slate") == "--G-G"
    assert feedback("crane", "eerie") == "--Y-G"  # one e in the secret, placed: the other e's are absent
    assert feedback("geese", "egret") == "YY-Y-"  # three e's unplaced, two guessed
    assert feedback("geese", "eerie") == "YG--G"


def test_games_played_to_the_end(server):
    env = wordle_env.factory(server)()
    assert "5-letter word in 6 tries" in env.reset(seed=1)
    assert env.get_reward() == 0.0  # not over yet
    assert env.guess(word="slate") == "--G-G (5 guesses left)"
    assert env.guess(word="crane") == "GGGGG (won)"
    assert env.get_reward() == 1.0
    state = wordle_env.call(server, "GET", f"/episodes/{env.episode}")
    assert state["guesses"] == [["slate", "--G-G"], ["crane", "GGGGG"]] and state["done"] and state["won"]

    lost = wordle_env.WordleEnv(server)
    lost.reset()
    for left in range(5, 0, -1):
        assert lost.guess(word="slate") == f"--G-G ({left} guesses left)"
    assert lost.guess(word="slate") == "--G-G (lost)"
    assert wordle_env.call(server, "GET", f"/episodes/{lost.episode}")["done"]
    assert lost.get_reward() == pytest.approx(0.5 * 2 / 5)  # best guess placed 2 of 5


def raw(url, method, route, data: bytes | None):
    request = urllib.request.Request(url + route, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_one_clear_error_and_other_episodes_go_on(server):
    playing = wordle_env.WordleEnv(server)
    playing.reset()
    assert playing.guess(word="slate").startswith("--G-G")

    with pytest.raises(wordle_env.WordleError, match=r"HTTP 404: unknown episode 'ep999'$"):
        wordle_env.call(server, "POST", "/episodes/ep999/guess", {"word": "crane"})
    for word in ("cr4ne", "cran", "CRANE", 12345, None):
        with pytest.raises(wordle_env.WordleError, match=rf"HTTP 400: guess {word!r}: give 5 lowercase letters a-z$"):
            wordle_env.call(server, "POST", f"/episodes/{playing.episode}/guess", {"word": word})
    assert raw(server, "POST", f"/episodes/{playing.episode}/guess", b"{not json") == (
        400, {"error": "the body is not JSON"})
    assert raw(server, "POST", "/episodes", b"[1]") == (400, {"error": "the body must be a JSON object"})
    assert raw(server, "GET", "/nowhere", None) == (404, {"error": "no route GET /nowhere"})
    with pytest.raises(wordle_env.WordleError, match=r"HTTP 400: seed 'x': give an integer"):
        wordle_env.call(server, "POST", "/episodes", {"seed": "x"})

    # None of that touched the game in progress: it goes on from its first guess and ends.
    assert playing.guess(word="crane") == "GGGGG (won)"
    state = wordle_env.call(server, "GET", f"/episodes/{playing.episode}")
    assert [g for g, _ in state["guesses"]] == ["slate", "crane"] and state["reward"] == 1.0
    with pytest.raises(wordle_env.WordleError, match=r"HTTP 409: episode 'ep\d+' is over \(2 guesses\); start another"):
        playing.guess(word="crane")


def test_trl_takes_the_environment_factory(server, tmp_path):
    """GRPOTrainer probes the factory's class: `guess` becomes its tool, `get_reward` a reward
    source named after the class, which scores a game played over HTTP."""
    import trl
    from datasets import Dataset

    import trl_tiny

    tokenizer = trl_tiny.make_tokenizer()
    # A chat template that renders tool calls (TRL checks), one TRL knows how to parse.
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    config = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                            max_steps=1, use_cpu=True, report_to="none", beta=0.0)
    trainer = trl.GRPOTrainer(model=trl_tiny.make_model(tokenizer), args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "play"}]] * 4}),
                              environment_factory=wordle_env.factory(server))
    assert [tool.__name__ for tool in trainer.tools] == ["guess"]
    assert trainer.reward_func_names == ["WordleEnv"]
    won, unfinished = wordle_env.WordleEnv(server), wordle_env.WordleEnv(server)
    for env in (won, unfinished):
        env.reset()
    won.guess(word="crane")
    assert trainer.reward_funcs[-1](environments=[won, unfinished]) == [1.0, 0.0]
