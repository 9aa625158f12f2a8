"""`cache_salt` over HTTP: requests with different salts (tenants) never share prefix-cache
blocks; the same salt does."""

import uuid

import pytest

from tests.entrypoints.openai.conftest import MODEL


def cached_tokens(client, route: str, text: str, salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    if route == "chat":
        # the text as the system message: the template's default system preamble, which
        # every other chat in the session shares (and caches), would be the first block
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": text},
                                   {"role": "user", "content": "Summarise."}],
            max_tokens=1, extra_body=extra)
    else:
        resp = client.completions.create(model=MODEL, prompt=text, max_tokens=1,
                                         extra_body=extra)
    return resp.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_two_salts_never_share_blocks(client, route):
    # a prompt no other test sends: several blocks long, unique to this run
    text = f"Tenant document {uuid.uuid4()}: " + " ".join(f"clause {i}" for i in range(60))
    assert cached_tokens(client, route, text, "alice") == 0
    assert cached_tokens(client, route, text, "alice") > 0  # same tenant: cached
    assert cached_tokens(client, route, text, "bob") == 0  # another tenant: not
    assert cached_tokens(client, route, text, None) == 0  # nor an unsalted request
    assert cached_tokens(client, route, text, "bob") > 0  # bob's own blocks now


def test_cache_salt_must_be_a_string(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"cache_salt": 7})
    assert "cache_salt" in str(err.value)
