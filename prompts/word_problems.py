"""School maths word problems written for this project: templates with random names, things and
numbers.

    word_problems(n, seed) -> n distinct questions, the same list for the same (n, seed)

The maths demo trains on these and is evaluated on GSM8K's test questions, which it never sees (the
prompt list is decontaminated against them like every training set). The target answers each one
itself (prepare.py --regenerate), so what the draft learns is the target's own step-by-step style
on grade-school arithmetic: several quantities, two to four operations, money, time, rates, parts.
"""

import random

NAMES = (
    "Anna Ben Carla David Emma Farid Grace Hiro Isla Jamal Kofi Lena Mateo Nadia Omar Priya Quinn "
    "Rosa Sam Tara Umar Vera Wen Xavier Yara Zoe Liam Mia Noah Ava Ethan Chloe Lucas Sofia Mason "
    "Aria Leo Maya Owen Nora"
).split()
THINGS = (
    "apples, oranges, pencils, stickers, marbles, cookies, cupcakes, books, toy cars, stamps, "
    "shells, candles, bracelets, notebooks, balloons, muffins, tomatoes, eggs, flowers, cards"
).split(", ")
CONTAINERS = ("boxes", "bags", "baskets", "packs", "jars", "crates", "trays")
JOBS = ("babysitting", "mowing lawns", "walking dogs", "tutoring", "washing cars")
PLACES = (
    "the bakery, the bookstore, the farmers market, the school fair, the toy shop, the cafe, "
    "the garden center"
).split(", ")

TEMPLATES = [
    "{A} has {n1} {C} of {T}. Each {c} holds {n2} {T}. {A} gives {n3} {T} to {B}. How many {T} "
    "does {A} have left?",
    "{A} buys {n1} {T} at {P} for ${p1} each and {n2} {T2} for ${p2} each. How much does {A} "
    "spend in total?",
    "{A} earns ${p1} an hour {J}. Last week {A} worked {n1} hours on Monday and {n2} hours on "
    "Saturday. How much money did {A} earn last week?",
    "A {c} of {T} costs ${p1} at {P}. {A} buys {n1} {C} and pays with a ${bill} bill. How much "
    "change does {A} get?",
    "{A} read {n1} pages on Monday and twice as many pages on Tuesday. If the book has {big} "
    "pages, how many pages are left to read?",
    "There are {big} students in a school. {pct}% of them take the bus and the rest walk. How "
    "many students walk?",
    "{A} had ${big}. {A} spent a quarter of it on {T} and ${p1} on lunch. How much money does {A} "
    "have now?",
    "{A} is {n1} years old. {B} is {n2} years older than {A}. How old will {B} be in {n3} years?",
    "A baker makes {n1} trays of {T} with {n2} on each tray. {A} sells {n3} of them in the "
    "morning and half of the rest in the afternoon. How many are left at the end of the day?",
    "{A} runs {n1} miles every weekday and {n2} miles on Saturday. How many miles does {A} run in "
    "{n3} weeks?",
    "{A} collects {T}. {A} had {n1} and then bought {n2} {C} with {n3} in each. {A} then lost "
    "{n4}. How many {T} does {A} have now?",
    "A train travels at {n1}0 miles per hour for {n2} hours and then at {n3}0 miles per hour for "
    "{n4} hours. How far does the train travel in total?",
    "{A} and {B} share {big} {T}. {A} gets {n1} more than {B}. How many {T} does {B} get?",
    "A shirt costs ${p3}. It is on sale for {pct}% off. {A} buys {n1} shirts. How much does {A} "
    "pay?",
    "{A} plants {n1} rows of {T2} with {n2} plants in each row. {n3} plants do not grow. How many "
    "plants grow?",
    "{A} saves ${p1} every week. How many weeks will it take {A} to save ${goal} for a bike?",
    "A class has {n1} boys and {n2} girls. The teacher puts them into groups of {g}. How many "
    "groups are there?",
    "{A} bought {n1} {C} of {T} with {n2} in each. {A} wants to give the same number to each of "
    "{g} friends. How many does each friend get?",
    "{A} drinks {n1} glasses of water a day. Each glass holds {n2}0 milliliters. How many liters "
    "does {A} drink in {n3} days?",
    "A recipe needs {n1} cups of flour for {n2} dozen {T}. How many cups of flour are needed for "
    "{n3} dozen {T}?",
    "{A} has three times as many {T} as {B}. {B} has {n1} {T}. How many {T} do they have together?",
    "A movie starts at {h}:15 PM and lasts {n1}0 minutes more than two hours. At what time does "
    "it end?",
    "{A} pays ${p3} a month for a phone plan and ${p1} a month for music. How much does {A} pay "
    "in a year?",
    "{A} scored {n1}, {n2} and {n3} points in three games. How many points does {A} need in the "
    "fourth game to have an average of {avg} points?",
    "A farmer has {n1} cows and {n2} chickens. How many legs do the animals have altogether?",
    "{A} walks {n1} blocks to school and {B} walks {n2} times as far. How many blocks do they "
    "walk together in {n3} school days, going and coming back?",
    "At {P}, {T} are sold in {C} of {n1}. {A} needs {big} {T}. How many {C} does {A} need to buy?",
    "{A} fills a pool that holds {big}0 liters at {n1}0 liters per minute. How many minutes does "
    "it take?",
    "{A} has ${p3}. {B} has ${p1} less than {A}. {A} and {B} put their money together to buy a "
    "game that costs ${goal}. How much money is left?",
    "A pizza is cut into {g} slices. {A} eats {n1} slices and {B} eats {n2} slices. What fraction "
    "of the pizza is left?",
    "{A} is making bracelets. Each bracelet needs {n1} beads. {A} has {big} beads. How many "
    "bracelets can {A} make and how many beads are left over?",
    "A store had {big} {T}. On Monday it sold {pct}% of them and on Tuesday it sold {n1} more. "
    "How many {T} are left?",
    "{A} works {n1} hours a day, {n2} days a week, and earns ${p1} an hour. How much does {A} "
    "earn in {n3} weeks?",
    "The perimeter of a rectangular garden is {per} meters. Its length is {n1} meters. What is "
    "its width?",
    "{A} buys a bike for ${goal} and sells it for {pct}% more. How much profit does {A} make?",
    "A bus can carry {n1}0 people. How many buses are needed for a school trip with {big} "
    "students and {n2} teachers?",
]


def fill(template: str, rng: random.Random) -> str:
    A, B = rng.sample(NAMES, 2)
    T, T2 = rng.sample(THINGS, 2)
    C = rng.choice(CONTAINERS)
    slots = dict(
        A=A,
        B=B,
        T=T,
        T2=T2,
        C=C,
        c=C[:-2] if C.endswith("xes") else C[:-1],
        P=rng.choice(PLACES),
        J=rng.choice(JOBS),
        n1=rng.randint(2, 9),
        n2=rng.randint(2, 9),
        n3=rng.randint(2, 9),
        n4=rng.randint(2, 9),
        g=rng.choice((3, 4, 5, 6, 8)),
        p1=rng.randint(2, 15),
        p2=rng.randint(2, 15),
        p3=rng.randint(20, 60),
        bill=rng.choice((50, 100)),
        big=rng.randint(12, 60) * 10,
        pct=rng.choice((10, 20, 25, 30, 40, 50, 75)),
        goal=rng.randint(10, 40) * 10,
        h=rng.randint(1, 8),
        avg=rng.randint(10, 30),
        per=rng.randint(20, 60) * 2,
    )
    return template.format(**slots)


def distinct(n: int, make, key=lambda x: x) -> list:
    """The first n of make(0), make(1), ... whose key is new (at most 50 n tries)."""
    out, seen = [], set()
    for i in range(50 * n):
        if len(out) == n:
            break
        x = make(i)
        if key(x) not in seen:
            seen.add(key(x))
            out.append(x)
    return out


def word_problems(n: int, seed: int = 0) -> list:
    """n distinct questions, templates taken in turn so every kind of problem is represented."""
    rng = random.Random(seed)
    return distinct(n, lambda i: fill(TEMPLATES[i % len(TEMPLATES)], rng))
