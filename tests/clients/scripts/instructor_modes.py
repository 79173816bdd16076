"""instructor's TOOLS and JSON_SCHEMA modes against kvledger's chat completions.

Usage: python instructor_modes.py BASE_URL MODEL (exit status 0 when every check holds)."""

import sys

import instructor
from openai import OpenAI
from pydantic import BaseModel

base_url, model = sys.argv[1], sys.argv[2]


class City(BaseModel):
    name: str
    country: str


for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="none"), mode=mode)
    city = client.chat.completions.create(
        model=model, response_model=City, temperature=0, max_tokens=200, max_retries=0,
        messages=[{"role": "user", "content": "Name a city in France and its country."}])
    assert isinstance(city, City) and city.name, city
    print(mode.name, city)
