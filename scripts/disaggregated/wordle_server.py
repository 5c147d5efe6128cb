"""The disaggregated loop's environment, in a process of its own: a Wordle-like game over HTTP
(standard library only). Each episode hides a word; a guess gets per-letter feedback (G: right
letter, right place; Y: in the word elsewhere; -: not in the word, as many Y as the word has
unplaced copies of the letter); the episode ends when the word is found or the guesses run out,
and only then has a reward: 1 for a win, else the share of letters placed right by the best
guess, halved.

    python wordle_server.py [--host 127.0.0.1] [--port 0] [--words a,b,c] [--max-guesses 6]

    POST /episodes                    {"seed": 7}          -> {"episode", "length", "max_guesses", "alphabet"}
    POST /episodes/ID/guess           {"word": "..."}      -> {"feedback", "guesses_left", "done", "won"}
    GET  /episodes/ID                                      -> {"guesses", "done", "won", "reward"}

A bad request (unknown route or episode, malformed body or guess, a guess after the end) gets
one status and one JSON line {"error": "..."} naming what was wrong; it changes no episode.
The first line on stdout is "listening on http://HOST:PORT" (port 0: a free one)."""
from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = ("crane", "slate", "bread", "trace", "scale", "baker", "brace", "cable", "table", "react")


def feedback(secret: str, guess: str) -> str:
    """Per-letter marks, Wordle's rule for repeated letters: greens first, then yellows while
    unplaced copies of the letter remain in the secret."""
    marks = ["-"] * len(secret)
    unplaced: dict[str, int] = {}
    for i, (s, g) in enumerate(zip(secret, guess)):
        if s == g:
            marks[i] = "G"
        else:
            unplaced[s] = unplaced.get(s, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != "G" and unplaced.get(g, 0) > 0:
            marks[i] = "Y"
            unplaced[g] -= 1
    return "".join(marks)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Game:
    """Every episode's state, behind one lock (handlers run in threads)."""

    def __init__(self, words, max_guesses: int):
        lengths = {len(w) for w in words}
        if len(lengths) != 1 or not all(re.fullmatch(r"[a-z]+", w) for w in words):
            raise ValueError(f"wordle_server: the words must be lowercase letters, all one length: {list(words)}")
        self.words = list(words)
        self.length = lengths.pop()
        self.alphabet = "".join(sorted(set("".join(self.words))))
        self.max_guesses = max_guesses
        self.episodes: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()

    def start(self, body: dict) -> dict:
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest(400, f"seed {seed!r}: give an integer or leave it out")
        word = random.Random(seed).choice(self.words)
        with self.lock:
            episode = f"ep{next(self.ids)}"
            self.episodes[episode] = {"secret": word, "guesses": [], "done": False, "won": False}
        return {"episode": episode, "length": self.length, "max_guesses": self.max_guesses,
                "alphabet": self.alphabet}

    def _episode(self, episode: str) -> dict:
        state = self.episodes.get(episode)
        if state is None:
            raise BadRequest(404, f"unknown episode {episode!r}")
        return state

    def guess(self, episode: str, body: dict) -> dict:
        word = body.get("word")
        if not isinstance(word, str) or not re.fullmatch(rf"[a-z]{{{self.length}}}", word):
            raise BadRequest(400, f"guess {word!r}: give {self.length} lowercase letters a-z")
        with self.lock:
            state = self._episode(episode)
            if state["done"]:
                raise BadRequest(409, f"episode {episode!r} is over ({len(state['guesses'])} guesses); start another")
            marks = feedback(state["secret"], word)
            state["guesses"].append((word, marks))
            state["won"] = marks == "G" * self.length
            state["done"] = state["won"] or len(state["guesses"]) >= self.max_guesses
            return {"feedback": marks, "guesses_left": self.max_guesses - len(state["guesses"]),
                    "done": state["done"], "won": state["won"]}

    def show(self, episode: str) -> dict:
        with self.lock:
            state = self._episode(episode)
            reward = None
            if state["done"]:
                best = max(marks.count("G") for _, marks in state["guesses"])
                reward = 1.0 if state["won"] else 0.5 * best / self.length
            return {"guesses": [list(g) for g in state["guesses"]], "done": state["done"], "won": state["won"],
                    "reward": reward}


def make_handler(game: Game):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the demo's stdout is its per-step lines
            pass

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                body = json.loads(raw or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest(400, "the body is not JSON") from None
            if not isinstance(body, dict):
                raise BadRequest(400, "the body must be a JSON object")
            return body

        def _route(self, method: str) -> dict:
            parts = self.path.strip("/").split("/")
            if method == "POST" and parts == ["episodes"]:
                return game.start(self._body())
            if method == "POST" and len(parts) == 3 and parts[0] == "episodes" and parts[2] == "guess":
                return game.guess(parts[1], self._body())
            if method == "GET" and len(parts) == 2 and parts[0] == "episodes":
                return game.show(parts[1])
            raise BadRequest(404, f"no route {method} {self.path}")

        def _handle(self, method: str) -> None:
            try:
                self._answer(200, self._route(method))
            except BadRequest as e:
                self._answer(e.status, {"error": str(e)})

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--words", default=",".join(WORDS), help="comma-separated secret words, all one length")
    ap.add_argument("--max-guesses", type=int, default=6)
    args = ap.parse_args()
    try:
        game = Game(args.words.split(","), args.max_guesses)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    server = ThreadingHTTPServer((args.host, args.port), make_handler(game))
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
