"""Write examples/gpt/data.txt: a deterministic synthetic corpus for the GPT example.

    python examples/gpt/make_data.py            # rewrites data.txt next to this file

The text is made here from small hand-written grammars (a harbour town's logbook, weather
reports, market lists, short dialogues, counting lines), so it is original, needs no download,
and has structure at several scales for a byte-level model to pick up: spelling, common words,
sentence shapes, recurring names, and simple arithmetic that is always right. The file is
committed; this script only documents how it was made (a fixed seed gives the same bytes).
"""

from __future__ import annotations

import random
from pathlib import Path

SEED = 1729
TARGET_BYTES = 48_000
OUT = Path(__file__).resolve().parent / "data.txt"

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen", "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["March", "April", "May", "June", "July", "August", "September", "October"]
PEOPLE = ["Ada", "Bruno", "Clara", "Dov", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonas"]
TRADES = {"Ada": "the lighthouse keeper", "Bruno": "the baker", "Clara": "the ferry pilot",
          "Dov": "the net mender", "Esme": "the schoolteacher", "Farid": "the clockmaker",
          "Greta": "the harbour master", "Hugo": "the carpenter", "Ines": "the doctor",
          "Jonas": "the fisherman"}
PLACES = ["the north pier", "the fish market", "the old chapel", "the salt warehouse",
          "the lighthouse", "the ferry ramp", "the bakery on Quay Street", "the boatyard",
          "the school by the dunes", "the clock tower"]
WINDS = ["north", "north-east", "east", "south-east", "south", "south-west", "west",
         "north-west"]
SKIES = ["clear", "hazy", "overcast", "patchy", "low and grey", "misty at dawn",
         "darkening later", "bright after rain"]
SEAS = ["calm", "slight", "moderate", "rough", "a long swell from the west"]
GOODS = {"loaves of rye bread": 3, "jars of honey": 5, "crates of herring": 12,
         "coils of rope": 7, "tins of tar": 4, "baskets of apples": 6, "sacks of flour": 9,
         "lamps": 8, "bundles of oak laths": 2, "spools of net twine": 1}
BOATS = ["the Marigold", "the Kestrel", "the Patient Anne", "the Little Auk", "the Wayfarer"]
CATCH = ["cod", "herring", "mackerel", "plaice", "crab", "whiting"]
ADJ = ["quiet", "busy", "cold", "bright", "windy", "grey", "mild", "still", "damp", "slow"]
VERBS_DONE = ["repaired the slipway", "painted the railings", "counted the crates",
              "checked the lamps", "swept the steps", "mended a torn sail", "tarred the hull",
              "wound the tower clock", "carried bread to the pier", "measured the tide"]
FEELINGS = ["pleased", "tired", "worried", "cheerful", "thoughtful", "impatient"]
SAYINGS = [
    "A calm sea never made a careful sailor.",
    "Count the ropes before you count the fish.",
    "The tide keeps its own clock.",
    "Bread and weather are both best in the morning.",
    "Mend the net while the sea is kind.",
    "A lamp is only as good as the hand that trims it.",
]


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


class Writer:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.day = 0

    def pick(self, items):
        return items[self.r.randrange(len(items))]

    def person(self) -> str:
        return self.pick(PEOPLE)

    # ---- genres ------------------------------------------------------------------------

    def log_entry(self) -> str:
        self.day += 1
        day = DAYS[self.day % 7]
        month = MONTHS[(self.day // 28) % len(MONTHS)]
        date = 1 + self.day % 28
        a, b = self.r.sample(PEOPLE, 2)
        boat = self.pick(BOATS)
        fish = self.pick(CATCH)
        n = self.r.randint(2, 20)
        lines = [f"LOG, {day} {date} {month}.",
                 f"A {self.pick(ADJ)} day at the harbour. Wind {self.pick(WINDS)}, sky "
                 f"{self.pick(SKIES)}, sea {self.pick(SEAS)}.",
                 f"{a}, {TRADES[a]}, {self.pick(VERBS_DONE)} near {self.pick(PLACES)}.",
                 f"{cap(boat)} came in at {self.r.randint(5, 11)} o'clock with {NUMBERS[n]} "
                 f"boxes of {fish}."]
        if self.r.random() < 0.5:
            lines.append(f"{b} was {self.pick(FEELINGS)} and said: \"{self.pick(SAYINGS)}\"")
        else:
            lines.append(f"{b} {self.pick(VERBS_DONE)} and went home before dark.")
        return " ".join(lines)

    def weather(self) -> str:
        wind = self.pick(WINDS)
        force = self.r.randint(2, 8)
        later = self.pick(WINDS)
        return (f"WEATHER. Wind {wind}, force {NUMBERS[force]}, backing {later} later. "
                f"Sky {self.pick(SKIES)}. Sea state {self.pick(SEAS)}. Visibility "
                f"{self.pick(['good', 'moderate', 'poor', 'good, becoming moderate'])}.")

    def market(self) -> str:
        who = self.person()
        items = self.r.sample(sorted(GOODS), 3)
        lines = [f"MARKET LIST of {who}:"]
        total = 0
        for item in items:
            count = self.r.randint(1, 4)
            price = GOODS[item]
            cost = count * price
            total += cost
            lines.append(f"  {NUMBERS[count]} {item} at {NUMBERS[price]} coins each makes "
                         f"{cost} coins;")
        lines.append(f"  in all {total} coins.")
        return "\n".join(lines)

    def dialogue(self) -> str:
        a, b = self.r.sample(PEOPLE, 2)
        place = self.pick(PLACES)
        boat = self.pick(BOATS)
        exchanges = [
            (f"Have you seen {boat} today?",
             [f"Not since the morning, {a}. Ask {self.person()}.",
              f"Yes, she came in at {self.r.randint(5, 11)} o'clock with {self.pick(CATCH)}."]),
            (f"Is the wind going {self.pick(WINDS)} tonight?",
             [f"I think so. {self.pick(SAYINGS)}", "I cannot say. Ask the harbour master."]),
            (f"Who left the lamp burning at {place}?",
             [f"That was {self.person()}, I think.", "Nobody did. It was the moon on the glass."]),
            (f"Will you help me at {place} tomorrow?",
             [f"Yes, after I have {self.pick(VERBS_DONE)}.", "Gladly, if the weather holds."]),
            ("What time is high water?",
             [f"High water is at {self.r.randint(1, 12)} o'clock, give or take.",
              "I cannot say. The tide keeps its own clock."]),
        ]
        question, answers = self.pick(exchanges)
        answer = self.pick(answers)
        return (f"{a}: {question}\n{b}: {answer}\n{a}: Thank you, {b}. "
                f"{self.pick(['Good night.', 'See you at the pier.', 'Mind the steps.'])}")

    def sums(self) -> str:
        lines = ["COUNTING, from the school by the dunes:"]
        for _ in range(self.r.randint(3, 5)):
            x, y = self.r.randint(0, 10), self.r.randint(0, 10)
            if self.r.random() < 0.6:
                lines.append(f"  {NUMBERS[x]} and {NUMBERS[y]} make {NUMBERS[x + y]}.")
            else:
                x, y = max(x, y), min(x, y)
                lines.append(f"  {NUMBERS[x]} take away {NUMBERS[y]} leaves {NUMBERS[x - y]}.")
        return "\n".join(lines)

    def story(self) -> str:
        a = self.person()
        b = self.pick([p for p in PEOPLE if p != a])
        place = self.pick(PLACES)
        thing = self.pick(["a brass key", "a green bottle", "a folded chart",
                           "an old compass", "a wooden whistle", "a letter with no name"])
        return (f"One {self.pick(ADJ)} evening {a} found {thing} at {place}. "
                f"{a} showed it to {b}, {TRADES[b]}, who turned it over twice and said nothing "
                f"for a while. \"It belongs to {self.pick(BOATS)},\" {b} said at last. "
                f"So they walked to {self.pick(PLACES)} together, and by the time the lamps "
                f"were lit, {thing} was back where it belonged.")

    def paragraph(self) -> str:
        genre = self.r.choices(
            [self.log_entry, self.weather, self.market, self.dialogue, self.sums, self.story],
            weights=[5, 2, 2, 3, 2, 2])[0]
        return genre()


def make_corpus(seed: int = SEED, target: int = TARGET_BYTES) -> str:
    writer = Writer(seed)
    parts = ["THE HARBOUR BOOK\n\nNotes kept at a small harbour town: the log, the weather, "
             "the market, what people said, and the children's sums.\n"]
    size = len(parts[0])
    while size < target:
        text = writer.paragraph() + "\n"
        parts.append(text)
        size += len(text) + 1
    return "\n".join(parts)


def main() -> None:
    text = make_corpus()
    OUT.write_text(text, encoding="ascii")
    print(f"wrote {OUT} ({len(text.encode('ascii'))} bytes)")


if __name__ == "__main__":
    main()
