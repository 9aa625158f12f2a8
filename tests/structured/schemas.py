"""The JSON schemas the structured-output suite generates against, each with the request a
user would send with it.

Every string has a `maxLength` (or a bounded `pattern`/`format`) and every array a
`maxItems`, so a complete object fits in the tests' `max_tokens` unless it holds a JSON
number (any number of fraction digits: a sampled 27.5534414393537838... runs to the limit,
as it did on the AVX2 kernels) or is the recursive one (`bounded=False`): only those may
end by length (`SchemaCase.length_bounded`).
"""

import json
import re
from dataclasses import dataclass

from jsonschema import Draft202012Validator, FormatChecker


@dataclass(frozen=True)
class SchemaCase:
    name: str
    request: str  # what the user asks for, in words
    schema: dict
    bounded: bool = True

    @property
    def length_bounded(self) -> bool:
        """Every output the schema accepts fits `max_tokens` (see the module docstring)."""
        return self.bounded and '"number"' not in json.dumps(self.schema)


def text(max_length: int, min_length: int = 1) -> dict:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """A closed object: `required` None means every property is."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


EMAIL = {"type": "string", "format": "email", "maxLength": 40}
DATE = {"type": "string", "format": "date"}
# the formats allow any number of fraction digits: bounded, or a sampled "20:00:00.8179..."
# runs to max_tokens
DATE_TIME = {"type": "string", "format": "date-time", "maxLength": 29}
HH_MM = {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}

SCHEMAS = [
    SchemaCase("person", "Describe a fictional person: name, age and email.", obj(
        {"name": text(24), "age": {"type": "integer", "minimum": 0, "maximum": 120},
         "email": EMAIL}, required=["name", "age"])),
    SchemaCase("colour", "Pick a colour and give its name and hex code.", obj(
        {"name": {"enum": ["red", "orange", "yellow", "green", "blue", "purple"]},
         "hex": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}})),
    SchemaCase("shipping_label", "Write a shipping label for a parcel.", obj(
        {"recipient": text(30),
         "address": obj({"street": text(40), "city": text(24),
                         "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                         "country": {"enum": ["FR", "DE", "US", "JP"]}})})),
    SchemaCase("todo_list", "Make a short to-do list for a weekend.", obj(
        {"title": text(30),
         "items": {"type": "array", "minItems": 1, "maxItems": 3,
                   "items": obj({"task": text(30), "done": {"type": "boolean"}})}})),
    SchemaCase("product", "Describe a product in a shop catalogue.", obj(
        {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": text(30),
         "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
         "tags": {"type": "array", "items": text(12), "maxItems": 3},
         "in_stock": {"type": "boolean"}}, required=["id", "name", "price"])),
    SchemaCase("weather", "Report today's weather in a city.", obj(
        {"city": text(24),
         "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
         "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
         "humidity": {"type": "integer", "minimum": 0, "maximum": 100}})),
    SchemaCase("meeting", "Schedule a team meeting with a date, a start time and attendees.",
               obj({"title": text(30), "date": DATE,
                    "start": {"type": "string", "format": "time", "maxLength": 14},
                    "attendees": {"type": "array", "items": EMAIL,
                                  "minItems": 1, "maxItems": 3}})),
    SchemaCase("shape", "Describe a circle or a rectangle by its size.", {"anyOf": [
        obj({"kind": {"const": "circle"},
             "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}}),
        obj({"kind": {"const": "rectangle"},
             "width": {"type": "number", "minimum": 0, "maximum": 100},
             "height": {"type": "number", "minimum": 0, "maximum": 100}})]}),
    SchemaCase("payment", "Record how a customer paid: card, cash or bank transfer.",
               {"oneOf": [
                   obj({"method": {"const": "card"},
                        "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                        "expiry": {"type": "string",
                                   "pattern": "^(0[1-9]|1[0-2])/[0-9]{2}$"}}),
                   obj({"method": {"const": "cash"},
                        "amount": {"type": "number", "minimum": 0, "maximum": 500}}),
                   obj({"method": {"const": "transfer"},
                        "iban": {"type": "string",
                                 "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"}})]}),
    SchemaCase("order", "Write an online order with a customer and its line items.", {
        "$defs": {
            "customer": obj({"name": text(24), "email": EMAIL}),
            "line": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                         "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                         "unit_price": {"type": "number", "minimum": 0, "maximum": 1000}}),
        },
        **obj({"customer": {"$ref": "#/$defs/customer"},
               "lines": {"type": "array", "items": {"$ref": "#/$defs/line"},
                         "minItems": 1, "maxItems": 3},
               "total": {"type": "number", "minimum": 0, "maximum": 30000}})}),
    SchemaCase("family_tree", "Draw a small family tree: a person and their children.", {
        "$defs": {"node": obj({"name": text(12),
                               "children": {"type": "array", "maxItems": 2,
                                            "items": {"$ref": "#/$defs/node"}}},
                              required=["name"])},
        "$ref": "#/$defs/node"}, bounded=False),
    SchemaCase("profile", "Fill in a user profile; unknown fields are null.", obj(
        {"username": text(16), "nickname": {"type": ["string", "null"], "maxLength": 16},
         "age": {"type": ["integer", "null"], "minimum": 13, "maximum": 110}})),
    SchemaCase("empty", "Reply with an empty JSON object.", obj({})),
    SchemaCase("shop_flags", "Say whether a shop is open, has parking and takes cards.", obj(
        {"is_open": {"type": "boolean"}, "has_parking": {"type": "boolean"},
         "accepts_cards": {"type": "boolean"}})),
    SchemaCase("api_status", "Report the API health check result.", obj(
        {"api": {"const": "v2"}, "version": {"const": 3}, "healthy": {"type": "boolean"}})),
    SchemaCase("stats", "Summarise a data set: count, mean and a ratio.", obj(
        {"count": {"type": "integer", "minimum": 0, "maximum": 1000},
         "mean": {"type": "number", "minimum": -1000, "maximum": 1000},
         "ratio": {"type": "number", "minimum": 0, "maximum": 1}})),
    SchemaCase("exam", "Give an exam score out of 10 and a level from 1 to 4.", obj(
        {"score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
         "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}})),
    SchemaCase("account", "Create a new account: username, password and PIN.", obj(
        {"username": {"type": "string", "minLength": 3, "maxLength": 12,
                      "pattern": "^[a-z][a-z0-9_]*$"},
         "password": text(16, min_length=8),
         "pin": {"type": "string", "pattern": "^[0-9]{4}$"}})),
    SchemaCase("readings", "List a few sensor readings between 0 and 100.", {
        "type": "array", "minItems": 2, "maxItems": 4,
        "items": {"type": "number", "minimum": 0, "maximum": 100}}),
    SchemaCase("matrix", "Write a small matrix of single-digit integers.", {
        "type": "array", "minItems": 2, "maxItems": 3,
        "items": {"type": "array", "minItems": 2, "maxItems": 3,
                  "items": {"type": "integer", "minimum": -9, "maximum": 9}}}),
    SchemaCase("t_shirt", "Choose a T-shirt size and fit.", obj(
        {"size": {"enum": ["XS", "S", "M", "L", "XL"]},
         "fit": {"enum": ["slim", "regular", None]}})),
    SchemaCase("birthday", "When is your birthday? Give just the date.", DATE),
    SchemaCase("server", "Describe a web server's address and protocol.", obj(
        {"host": {"type": "string", "format": "ipv4"},
         "port": {"type": "integer", "minimum": 1, "maximum": 65535},
         "ipv6": {"type": "string", "format": "ipv6", "maxLength": 39},
         "protocol": {"enum": ["http", "https"]}}, required=["host", "port", "protocol"])),
    SchemaCase("session", "Create a login session token record.", obj(
        {"id": {"type": "string", "format": "uuid"}, "user": text(16),
         "expires": DATE_TIME})),
    SchemaCase("book", "Describe a book you like.", obj(
        {"title": text(40), "author": text(30),
         "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
         "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
         "genres": {"type": "array", "maxItems": 2,
                    "items": {"enum": ["fiction", "science", "history", "poetry"]}}},
        required=["title", "author"])),
    SchemaCase("settings", "Change some app settings (only the ones you want).", obj(
        {"theme": {"enum": ["light", "dark"]},
         "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
         "notifications": {"type": "boolean"}}, required=[])),
    SchemaCase("employee", "Describe an employee: name, department and salary.", {"allOf": [
        {"type": "object", "properties": {"name": text(24)}, "required": ["name"]},
        {"properties": {"department": {"enum": ["sales", "it", "hr"]},
                        "salary": {"type": "integer", "minimum": 1000, "maximum": 99999}},
         "required": ["department", "salary"]}]}),
    SchemaCase("grades", "Give grades for up to three subjects.", {
        "type": "object", "minProperties": 1, "maxProperties": 3,
        "patternProperties": {"^[a-z]{1,10}$": {"type": "integer", "minimum": 0,
                                                 "maximum": 100}},
        "additionalProperties": False}),
    SchemaCase("user_row", "Give a database row: name, age and active flag.", {
        "type": "array", "prefixItems": [text(16), {"type": "integer", "minimum": 0,
                                                    "maximum": 120}, {"type": "boolean"}],
        "minItems": 3, "items": False}),
    SchemaCase("http_request", "Write an HTTP request: method, path and headers.", obj(
        {"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
         "path": {"type": "string", "pattern": "^/[a-z0-9/_-]{0,24}$"},
         "headers": {"type": "array", "maxItems": 2, "items": obj(
             {"name": {"type": "string", "pattern": "^[A-Za-z-]{1,20}$"},
              "value": text(30)})},
         "body": {"type": ["string", "null"], "maxLength": 40}})),
    SchemaCase("place", "Give the coordinates of a famous place.", obj(
        {"label": text(20), "lat": {"type": "number", "minimum": -90, "maximum": 90},
         "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    SchemaCase("version", "What version is this software? Give a semantic version.", {
        "type": "string",
        "pattern": r"^(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)$"}),
    SchemaCase("config_entry", "Give one configuration key and its value.", obj(
        {"key": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
         "value": {"anyOf": [{"type": "integer", "minimum": -1000, "maximum": 1000},
                             text(10, min_length=0), {"type": "boolean"},
                             {"type": "null"}]}})),
    SchemaCase("recipe", "Write a simple recipe.", obj(
        {"name": text(30), "servings": {"type": "integer", "minimum": 1, "maximum": 12},
         "ingredients": {"type": "array", "minItems": 1, "maxItems": 4, "items": obj(
             {"item": text(20),
              "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
              "unit": {"enum": ["g", "ml", "tbsp", "tsp", "piece"]}})},
         "vegetarian": {"type": "boolean"},
         "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": text(60)}})),
    SchemaCase("pack", "How many items per pack, and the price in quarters of a euro?", obj(
        {"quantity": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
         "price": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 100}})),
    SchemaCase("booking", "Book a room from a start to an end date and time.", {
        "$defs": {"slot": obj({"date": DATE, "time": HH_MM})},
        **obj({"room": {"type": "string", "pattern": "^[A-D][0-9]{2}$"},
               "start": {"$ref": "#/$defs/slot"}, "end": {"$ref": "#/$defs/slot"}})}),
    SchemaCase("log_entry", "Write one application log entry.", obj(
        {"level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
         "timestamp": DATE_TIME,
         "message": text(60), "code": {"type": ["integer", "null"], "minimum": 0,
                                       "maximum": 999}})),
    SchemaCase("contacts", "List one or two contacts with phone and email.", {
        "type": "array", "minItems": 1, "maxItems": 2, "items": obj(
            {"name": text(24), "phone": {"type": "string", "pattern": r"^\+[0-9]{7,12}$"},
             "email": EMAIL})}),
]

# "date", "time" and "date-time" as RFC 3339 defines them (section 5.6, with 5.7's limits:
# the day exists in that month and year, leap second 60 allowed, an offset required).
# jsonschema checks "date" with `date.fromisoformat` (no year 0000, which RFC 3339 allows)
# and the other two only with an optional package, so all three are checked here.
_TIME = (r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?"
         r"([zZ]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
_DATE = r"([0-9]{4})-([0-9]{2})-([0-9]{2})"
FORMATS = FormatChecker()


def _is_real_date(match: re.Match) -> bool:
    year, month, day = (int(part) for part in match.groups()[:3])
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]


@FORMATS.checks("date")
def _is_date(value: object) -> bool:
    match = re.fullmatch(_DATE, value) if isinstance(value, str) else None
    return not isinstance(value, str) or (match is not None and _is_real_date(match))


@FORMATS.checks("date-time")
def _is_date_time(value: object) -> bool:
    match = re.fullmatch(_DATE + "[tT ]" + _TIME, value) if isinstance(value, str) else None
    return not isinstance(value, str) or (match is not None and _is_real_date(match))


@FORMATS.checks("time")
def _is_time(value: object) -> bool:
    return not isinstance(value, str) or re.fullmatch(_TIME, value) is not None


def validator(schema: dict) -> Draft202012Validator:
    """Draft 2020-12 with the formats checked (date, time, date-time, email, ipv4, ipv6,
    uuid); the schema itself is checked against the meta-schema first."""
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=FORMATS)
