"""In-process micro-benchmark of a ``chat_shared`` request's tokenizing: a cached system prompt, a new
user message.

Not part of ``kvlb bench``: a probe of what ``tokenize`` does on the event loop for such a chat
(``encode_chat_if_cached`` with the request path's budget of 4,096 new characters, then
``compact_ids``, the ``array('I')`` the request keeps), without HTTP. The embedded tokenizer, 4 system
prompts of about 8,128 tokens (cached by a warm-up), 400 chats that pair one of them with a new
64-token user message. Prints the best of 5 runs of 200 chats, and the process's CPU time per chat
over all of them.

    PYTHONPATH=$PWD python loadtests/bench/tokenize_micro.py
"""

from __future__ import annotations

import random
import time
import timeit

from balancer.index.hashing import compact_ids
from balancer.tokenizer.default import default_tokenizer
from loadtests.workloads.text import TOKENS_PER_WORD, random_text, words_for_tokens


def main() -> None:
    tokenizer = default_tokenizer()
    rng = random.Random(0)
    systems = [random_text(rng, words_for_tokens(8128, TOKENS_PER_WORD)) for _ in range(4)]
    question_words = words_for_tokens(64, TOKENS_PER_WORD)
    chats = [
        [
            {"role": "system", "content": systems[i % len(systems)]},
            {"role": "user", "content": f"Question {i}: {random_text(rng, question_words)}"},
        ]
        for i in range(400)
    ]
    for chat in chats[:8]:  # every system prompt into the segment cache
        tokenizer.encode_chat_if_cached(chat, {}, 10**9)
    turn = iter(range(8, 10**9))

    def one() -> object:
        ids = tokenizer.encode_chat_if_cached(chats[next(turn) % len(chats)], {}, 4096)
        assert ids is not None
        return compact_ids(ids)

    runs, number = 5, 200
    cpu_started = time.process_time()
    best = min(timeit.repeat(one, number=number, repeat=runs)) / number
    cpu = (time.process_time() - cpu_started) / (runs * number)
    print(f"chat_shared tokenize + compact_ids: best {best * 1e6:.1f} us, cpu {cpu * 1e6:.1f} us per chat")


if __name__ == "__main__":
    main()
