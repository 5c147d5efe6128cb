"""The trainer's side of the Wordle environment (wordle_server.py, another process): TRL's
`environment_factory` contract, one instance per rollout (GRPOTrainer(environment_factory=...)).

    factory = wordle_env.factory("http://127.0.0.1:PORT")
    env = factory(); text = env.reset(seed=3); env.guess(word="crane"); ...; env.get_reward()

reset() starts an episode on the server and returns the instructions; guess() is the tool the
model calls; get_reward() is the episode's reward once it is over (0 while unfinished: a rollout
that stopped guessing lost). Nothing but HTTP (standard library) between the two."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


class WordleError(RuntimeError):
    """The environment server refused a request; the message is its one-line reason."""


def call(url: str, method: str, route: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read()).get("error")
        except (json.JSONDecodeError, AttributeError):
            reason = None
        raise WordleError(f"wordle {method} {route}: HTTP {e.code}: {reason or e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise WordleError(f"wordle {method} {url}{route}: {getattr(e, 'reason', e)}") from None


class WordleEnv:
    def __init__(self, url: str):
        self.url = url
        self.episode: str | None = None
        self.length = 0

    def reset(self, **example) -> str:
        """A new episode (the dataset row's `seed`, when it has one, picks the word)."""
        info = call(self.url, "POST", "/episodes", {"seed": example.get("seed")})
        self.episode, self.length = info["episode"], info["length"]
        return (f"Guess the hidden {info['length']}-letter word in {info['max_guesses']} tries with the guess "
                f"tool. Feedback per letter: G right place, Y elsewhere in the word, - absent.")

    def guess(self, word: str) -> str:
        """Guess the hidden word.

        Args:
            word: The guess, lowercase letters, as long as the hidden word.

        Returns:
            The feedback, one mark per letter (G right place, Y elsewhere in the word, - absent), and whether
            the game is over.
        """
        if self.episode is None:
            raise WordleError("wordle: guess() before reset()")
        answer = call(self.url, "POST", f"/episodes/{self.episode}/guess", {"word": word})
        state = "won" if answer["won"] else ("lost" if answer["done"] else f"{answer['guesses_left']} guesses left")
        return f"{answer['feedback']} ({state})"

    def get_reward(self) -> float:
        if self.episode is None:
            return 0.0
        reward = call(self.url, "GET", f"/episodes/{self.episode}")["reward"]
        return 0.0 if reward is None else float(reward)


def factory(url: str):
    """What GRPOTrainer's environment_factory takes: a callable making one WordleEnv per rollout."""
    return lambda: WordleEnv(url)


def start(log: Path, python: str = sys.executable, words: str | None = None,
          max_guesses: int | None = None) -> tuple[subprocess.Popen, str]:
    """Starts wordle_server.py in its own process (port chosen by the server); returns it and its
    URL once it listens. Its stderr goes to `log`."""
    cmd = [python, str(HERE / "wordle_server.py"), "--port", "0"] + (["--words", words] if words else [])
    cmd += ["--max-guesses", str(max_guesses)] if max_guesses else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the Wordle server did not start ({line!r}); see {log}")
    return proc, line.removeprefix("listening on ")
