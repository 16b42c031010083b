"""Made-up reports, each holding exactly one numeric fact, for checking that a compressed context keeps a number.

``reports(count=20, seed=0)`` writes ``count`` plausible prose reports (about 1,200-1,800 tokens for the default
model's tokenizer, SmolLM2-135M-Instruct) on made-up organisations. The filler paragraphs hold no digits; one
sentence, placed at a depth that varies from report to report, states a number with its unit ("2,750 litres per
second"). ``Report.question`` asks for it and ``Report.answer`` is the number as written in the text. Pure Python,
seeded, no network: the same arguments give the same reports.
"""

from __future__ import annotations

import dataclasses
import random

__all__ = ["Report", "reports"]


@dataclasses.dataclass(frozen=True)
class Report:
    text: str
    question: str
    answer: str  # the number as the text writes it, e.g. "2,750"
    depth: float  # where the fact sits, as a fraction of the paragraphs before it


ORGANISATIONS = [
    ("the Harrowgate Water Authority", "water utility"), ("Velmont Regional Transit", "transit operator"),
    ("the Corrin Valley Energy Cooperative", "energy cooperative"), ("Brightwell Municipal Services", "council"),
    ("the Ostrava Lake Conservancy", "conservancy"), ("Pellridge Port Holdings", "port operator"),
    ("the Kestrel Bay Hospital Trust", "hospital trust"), ("Amberfield Agricultural Board", "farming board"),
    ("the Dunmore Forestry Commission", "forestry commission"), ("Tollan Metro Waste Partnership", "waste partnership"),
]
PLACES = ["the northern district", "the river corridor", "the old harbour", "the eastern uplands", "the market town",
          "the coastal strip", "the industrial estate", "the southern valley", "the city centre", "the outer suburbs"]
TOPICS = ["maintenance planning", "staff training", "public consultation", "procurement", "risk management",
          "community outreach", "data reporting", "environmental monitoring", "budget oversight", "supplier relations",
          "health and safety", "digital services", "asset renewal", "customer complaints", "long-term strategy"]
PEOPLE = ["Miriam Achebe", "Tomasz Keller", "Aoife Brennan", "Rafael Ortega", "Ingrid Solberg", "Daniel Mensah",
          "Priya Raman", "Henrik Vogel", "Lucia Ferraro", "Samuel Whitlock", "Yuki Tanabe", "Olga Petrenko"]
ROLES = ["the chief executive", "the head of operations", "the board chair", "the finance director",
         "the lead engineer", "the programme manager", "the director of planning", "the compliance officer"]
SENTENCES = [
    "During the year {org} continued its work on {topic} across {place}, "
    "building on the priorities agreed by the board.",
    "{person}, {role}, noted that progress on {topic} had been steady but uneven, "
    "and that {place} needed more attention.",
    "Residents of {place} took part in several workshops, and their comments shaped the next phase of {topic}.",
    "The review of {topic} found that existing procedures were broadly sound, though some records were incomplete.",
    "A working group on {topic} met regularly and reported its findings to {role}, who welcomed the candid tone.",
    "Several contracts linked to {topic} were renegotiated, which gave {org} more flexibility in {place}.",
    "Staff in {place} described the changes to {topic} as a welcome simplification of their daily routines.",
    "{person} led a small team that reviewed how {topic} is recorded, and recommended clearer guidance for managers.",
    "Weather disruption in {place} delayed some of the planned work on {topic}, but most milestones were still met.",
    "The board asked for a fuller account of {topic} next year, with particular reference to {place}.",
    "An independent adviser praised the openness of {org} about {topic}, while urging faster decisions.",
    "Feedback from partners suggested that {topic} could be coordinated more closely with neighbouring bodies.",
    "{role} thanked the teams in {place} for their patience while new systems for {topic} were introduced.",
    "Work on {topic} will continue into the coming year, with a revised plan to be published in the spring.",
    "Auditors examined the arrangements for {topic} and raised no serious concerns, "
    "though they suggested minor changes.",
    "A pilot scheme in {place} tested a new approach to {topic}, and early results were described as encouraging.",
]
# (fact sentence, question, unit) with {org}, {place}, {n}; the number is drawn from the range given
FACTS = [
    ("The new pumping station in {place} reached a peak discharge capacity of {n} litres per second.",
     "What peak discharge capacity did the new pumping station reach?", (1200, 9800)),
    ("The main storage reservoir serving {place} now holds {n} cubic metres when full.",
     "How many cubic metres does the main storage reservoir hold when full?", (15000, 98000)),
    ("The replacement cable laid under {place} has a rated capacity of {n} kilowatts.",
     "What is the rated capacity of the replacement cable?", (1100, 8900)),
    ("The refurbished depot in {place} covers a floor area of {n} square metres.",
     "What floor area does the refurbished depot cover?", (2100, 9700)),
    ("The new pipeline running through {place} measures {n} metres from end to end.",
     "How long is the new pipeline, from end to end?", (1300, 8600)),
    ("The flood barrier protecting {place} can hold back {n} tonnes of water pressure.",
     "How many tonnes of water pressure can the flood barrier hold back?", (1400, 9300)),
    ("The solar array installed in {place} produced {n} megawatt hours over its first season.",
     "How many megawatt hours did the solar array produce over its first season?", (1250, 7900)),
    ("The cooling system at the {place} data hall circulates {n} litres of water per minute.",
     "How many litres of water per minute does the cooling system circulate?", (1150, 6400)),
]


def _number(rng: random.Random, low: int, high: int) -> str:
    return f"{rng.randrange(low, high, 5):,}"


def _paragraph(rng: random.Random, org: str) -> str:
    fill = lambda s: s.format(org=org, topic=rng.choice(TOPICS), place=rng.choice(PLACES),  # noqa: E731
                              person=rng.choice(PEOPLE), role=rng.choice(ROLES))
    return " ".join(fill(s) for s in rng.sample(SENTENCES, rng.randint(4, 6)))


def reports(count: int = 20, seed: int = 0) -> list[Report]:
    """``count`` reports, the same for the same ``seed``; the fact's depth runs evenly over 0.1-0.9."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        org, kind = ORGANISATIONS[index % len(ORGANISATIONS)]
        sentence, question, (low, high) = FACTS[index % len(FACTS)]
        number = _number(rng, low, high)
        paragraphs = [_paragraph(rng, org) for _ in range(rng.randint(11, 14))]
        depth = 0.1 + 0.8 * (index * 7 % count) / max(count - 1, 1)
        at = round(depth * len(paragraphs))
        place = rng.choice(PLACES)
        paragraphs[at] += " " + sentence.format(place=place, n=number)
        title = f"Annual report of {org[4:] if org.startswith('the ') else org}, a {kind}"
        text = title + "\n\n" + "\n\n".join(paragraphs)
        out.append(Report(text=text, question=question, answer=number, depth=at / len(paragraphs)))
    return out
