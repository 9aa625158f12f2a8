"""Images named by `http(s)` URLs, fetched where the operator allows it
(`--allowed-media-domains`): none by default, so a request can make the server reach no
host. A fetch runs on the event loop (I/O only, never blocking it), within a byte cap and a
timeout, following redirects only within the allowed hosts; the bytes become a data URL,
decoded like any other (off the loop, `multimodal/images.py`)."""

import base64
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from llmserve.entrypoints.openai.protocol import BadRequest, ChatMessage, ImageURL
from llmserve.multimodal.images import MAX_IMAGE_BYTES

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaFetcher:
    allowed_domains: tuple[str, ...] = ()  # hosts images may come from; empty: none
    timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES

    def allows(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        return any(host == d or host.endswith(f".{d}") for d in self.allowed_domains)

    async def inline_images(self, messages: list[ChatMessage]) -> None:
        """Every `http(s)` image_url part of `messages` fetched and replaced by its data URL
        (in place); a URL not allowed, unreachable, redirected elsewhere, too large or not
        an image is a 400 naming its part."""
        for i, message in enumerate(messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                url = part.image_url.url if isinstance(part.image_url, ImageURL) \
                    else part.image_url
                if part.type != "image_url" or not isinstance(url, str) or \
                        not url.lower().startswith(("http://", "https://")):
                    continue
                data_url = await self._fetch(url, f"messages[{i}].content[{j}]")
                if isinstance(part.image_url, ImageURL):
                    part.image_url.url = data_url
                else:
                    part.image_url = data_url

    async def _fetch(self, url: str, where: str) -> str:
        if not self.allowed_domains:
            raise BadRequest("this server fetches no image URLs (start it with "
                             "--allowed-media-domains); send the image as a data URL",
                             param=where)
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False,
                                         trust_env=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    if not self.allows(url):
                        raise BadRequest(f"image host {urlsplit(url).hostname!r} is not in "
                                         "--allowed-media-domains", param=where)
                    async with client.stream("GET", url) as response:
                        if response.is_redirect:
                            url = urljoin(url, response.headers.get("location", ""))
                            continue
                        if response.status_code != 200:
                            raise BadRequest(f"fetching the image: HTTP {response.status_code}",
                                             param=where)
                        body = await self._read(response, where)
                        kind = response.headers.get("content-type", "image/*").split(";")[0]
                        return f"data:{kind};base64,{base64.b64encode(body).decode()}"
                raise BadRequest(f"fetching the image: over {MAX_REDIRECTS} redirects",
                                 param=where)
        except httpx.HTTPError as e:
            raise BadRequest(f"fetching the image: {type(e).__name__}: {e}", param=where) \
                from None

    async def _read(self, response: httpx.Response, where: str) -> bytes:
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.max_bytes:
                raise BadRequest(f"the image is over {self.max_bytes} bytes", param=where)
            chunks.append(chunk)
        return b"".join(chunks)
