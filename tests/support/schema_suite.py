"""Pydantic models as applications write them, for tests/test_openai_structured.py: `SUITE`
is at least 30 distinct schemas (nested objects, enums, arrays with minItems, Optional fields,
$defs/$ref, Literal, tagged and plain unions, recursion, formats, patterns, bounded numbers).

Every string is bounded (maxLength, a pattern, a format or an enum) and every number bounded or
an integer, so the scripted model's walk under the constraint ends: an unbounded float or string
would run to max_tokens (its lowest allowed id is always another digit or character), which is
the model's limit, not the constraint's.
"""

from __future__ import annotations

import datetime
import enum
import ipaddress
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip: int = Field(ge=0, le=99)


class Person(BaseModel):
    """Nested objects, an enum (through $defs/$ref), arrays with minItems, an optional field."""

    name: str = Field(max_length=8)
    color: Color
    tags: list[Literal["a", "b"]] = Field(min_length=2, max_length=3)
    home: Address
    nickname: Optional[str] = Field(default=None, max_length=4)  # noqa: UP045 (what users write)
    previous: list[Address] = Field(min_length=1, max_length=2)
    active: bool


Digit = Annotated[int, Field(ge=0, le=9)]
Short = Annotated[str, Field(max_length=5)]


class Level(enum.IntEnum):
    low = 1
    high = 2


class Flat(BaseModel):
    s: Short
    n: Digit
    ok: bool


class Coded(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{2}-\d{3}$")
    zone: Optional[str] = Field(default=None, pattern=r"^z[0-9]$")  # noqa: UP045


class Sized(BaseModel):
    s: str = Field(min_length=3, max_length=5)
    xs: list[Digit] = Field(min_length=3, max_length=4)


class Stepped(BaseModel):
    n: int = Field(ge=0, le=100, multiple_of=5)
    m: int = Field(gt=-5, lt=5)
    free: int


class Dated(BaseModel):
    day: datetime.date
    at: datetime.datetime
    time: datetime.time


class Ids(BaseModel):
    id: uuid.UUID
    v4: ipaddress.IPv4Address
    v6: ipaddress.IPv6Address


class Contact(BaseModel):
    email: str = Field(max_length=20, json_schema_extra={"format": "email"})
    site: str = Field(max_length=20, json_schema_extra={"format": "uri"})


class Pair(BaseModel):
    pair: tuple[Digit, Literal["a", "b"]]


class Graded(BaseModel):
    level: Level
    color: Color
    levels: list[Level] = Field(min_length=2, max_length=2)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: Digit


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Tagged(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="kind")  # noqa: UP007 (oneOf with a discriminator)


class Either(BaseModel):
    pet: Union[Cat, Dog, None]  # noqa: UP007 (anyOf)
    pets: list[Union[Cat, Dog]] = Field(min_length=1, max_length=2)  # noqa: UP007


class Tree(BaseModel):
    value: Digit
    children: list["Tree"] = Field(max_length=2)


class Constants(BaseModel):
    version: Literal[2]
    mode: Literal["fast", "slow"]
    nothing: None
    small: Literal[1, 2, 3]


class Maybe(BaseModel):
    home: Optional[Address]  # noqa: UP045
    scores: list[Optional[Digit]] = Field(min_length=2, max_length=3)  # noqa: UP045


class Route(BaseModel):
    """The same model twice: one $defs entry, two $refs."""

    start: Address
    end: Address
    stops: list[Address] = Field(min_length=1, max_length=2)


class Employee(BaseModel):
    name: Short
    level: Level


class Team(BaseModel):
    lead: Employee
    members: list[Employee] = Field(min_length=2, max_length=3)


class Company(BaseModel):
    """Three levels of nesting through $defs."""

    name: Short
    teams: list[Team] = Field(min_length=1, max_length=2)


class Described(BaseModel):
    """Titles, descriptions, examples and defaults: annotations the compiler ignores."""

    title: Short = Field(default="x", title="Title", description="What it is called", examples=["abc"])
    count: Digit = Field(default=1, description="How many")


class Aliased(BaseModel):
    user_name: Short = Field(alias="userName")
    user_id: Digit = Field(alias="userId")


class Matrix(BaseModel):
    rows: list[Annotated[list[Digit], Field(min_length=1, max_length=3)]] = Field(min_length=2, max_length=2)


class Keyed(BaseModel):
    counts: dict[Annotated[str, Field(pattern=r"^[a-z]$")], Digit] = Field(max_length=2)


class Settings(BaseModel):
    theme: Literal["dark", "light"]
    font: Optional[Literal["mono", "sans"]]  # noqa: UP045
    size: int = Field(ge=8, le=32)
    flags: list[bool] = Field(min_length=1, max_length=3)


class Event(BaseModel):
    name: Short
    when: datetime.date
    where: Optional[Address] = None  # noqa: UP045
    tags: list[Literal["a", "b"]] = Field(min_length=1, max_length=2)


class Order(BaseModel):
    id: uuid.UUID
    lines: list[Pair] = Field(min_length=1, max_length=2)
    status: Literal["new", "paid", "sent"]


class Signed(BaseModel):
    delta: int = Field(ge=-99, le=-10)
    sign: Literal["+", "-"]


class Wrapped(BaseModel):
    inner: Flat
    maybe: Optional[Flat]  # noqa: UP045
    many: list[Flat] = Field(min_length=1, max_length=1)


class Bare(BaseModel):
    """No properties at all: only {}."""


SUITE = [
    Person, Flat, Coded, Sized, Stepped, Dated, Ids, Contact, Pair, Graded, Cat, Tagged, Either, Tree, Constants,
    Maybe, Route, Address, Employee, Team, Company, Described, Aliased, Matrix, Keyed, Settings, Event, Order,
    Signed, Wrapped, Bare,
]
