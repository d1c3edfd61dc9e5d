"""The user messages of benchmarks/speculative.py: answers that copy their input, and open chat.

COPY holds three kinds, three of each, in the order code / JSON / quote repeated, so that the
first three cover every kind: rewrite code with one change, extract fields as JSON, repeat a
quoted passage. CHAT holds open questions whose answers repeat little of the question.
"""

from __future__ import annotations

_CODE = [
    '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best''',
    '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        if word in self.counts:
            self.counts[word] += 1
        else:
            self.counts[word] = 1

    def most_common(self):
        return max(self.counts, key=self.counts.get)''',
    '''def read_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings''',
]
_CODE_CHANGES = [
    "Rewrite this Python code with one change: rename the variable `subtotal` to `net`. Output only the code.",
    "Rewrite this Python code with one change: rename the method `add` to `record`. Output only the code.",
    "Rewrite this Python code with one change: rename the variable `settings` to `options`. Output only the code.",
]

_RECORDS = [
    "Maria Gonzalez is a senior engineer at Northwind Traders in Seattle. Her email is maria.gonzalez@northwind.example "
    "and her phone number is 206-555-0142. She joined the company in 2019.",
    "Order 48213 was placed by Kenji Watanabe on 12 March 2024 for three blue ceramic mugs at 14 dollars each, "
    "shipped to 221 Baker Street, Portland, with tracking number ZX-99812-PL.",
    "The Riverside Community Library, at 15 Elm Avenue in Springfield, opens at 9 am and closes at 8 pm on weekdays. "
    "Its director is Amelia Hart and its phone number is 555-0199.",
]
_FIELDS = [
    "name, job title, company, city, email, phone and year joined",
    "order number, customer, date, item, quantity, unit price, address and tracking number",
    "name, address, city, opening time, closing time, director and phone",
]

_PASSAGES = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair.",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through a process called "
    "cellular respiration, which takes place in several steps: glycolysis, the citric acid cycle, and oxidative "
    "phosphorylation.",
    "To reset your password, open the settings page, choose Account, then Security, and press the button labelled "
    "Reset password. You will receive an email with a link that stays valid for twenty-four hours. Follow the link "
    "and choose a new password of at least twelve characters.",
]

COPY = [
    message
    for i in range(3)
    for message in (
        f"{_CODE_CHANGES[i]}\n\n```python\n{_CODE[i]}\n```",
        f"Extract these fields as a JSON object: {_FIELDS[i]}.\n\nText: {_RECORDS[i]}",
        f'Repeat the following passage exactly, word for word:\n\n"{_PASSAGES[i]}"',
    )
]

CHAT = [
    "What are some good ways to stay focused while studying?",
    "Why is the sky blue?",
    "Give me three ideas for a weekend trip with children.",
    "How does a bicycle stay upright when it moves?",
    "What should I consider before adopting a dog?",
    "Explain what a black hole is to a ten-year-old.",
    "What are the benefits of learning a second language?",
    "How do plants make their food?",
]
