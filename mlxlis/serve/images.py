"""Images in requests: the bytes an API's image part carries, from a `data:` URL (base64) or,
when the server runs with --allow-image-urls, fetched from an http(s) URL within a size and
time limit. Every refusal is a 400 naming the part. Fetches run on their own threads before
a request is prepared (service.py), so a slow host delays only its own request."""

from __future__ import annotations

import base64
import binascii
import http.client
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from mlxlis.serve.openai_format import APIError

MAX_IMAGE_BYTES = 20 << 20  # one image's encoded bytes
FETCH_SECONDS = 10.0  # an image URL's whole fetch
SCHEMES = ("http://", "https://")
# the fetches' own threads: a slow host holds one of these, never the preparing thread nor
# the event loop's default executor (which the server's shutdown uses)
FETCHERS = ThreadPoolExecutor(4, "mlxlis-image-fetch")


class _HTTPOnly(urllib.request.HTTPRedirectHandler):
    """Redirects followed to http(s) only (urllib's own would follow ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's)
        if not newurl.lower().startswith(SCHEMES):
            raise urllib.error.URLError(f"a redirect to {newurl.split(':', 1)[0]}: refused")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HTTPOnly, urllib.request.ProxyHandler({}))


def bad(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def data_url(media_type: str, data: str) -> str:
    return f"data:{media_type};base64,{data}"


def from_data_url(url: str, param: str) -> bytes:
    """The bytes of a `data:<type>;base64,<data>` URL."""
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise bad("expected a base64 data URL (data:image/png;base64,...)", param)
    if len(body) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad(f"an image over {MAX_IMAGE_BYTES >> 20} MiB", param)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise bad("the data URL's base64 is not valid", param) from None


def image_bytes(url: str, param: str) -> bytes:
    """The bytes of an image part's URL as a prepared request holds it (a data: URL)."""
    if url.startswith("data:"):
        return from_data_url(url, param)
    if url.startswith(SCHEMES):  # the fetch happens before preparing, when it is allowed
        raise bad("image URLs are fetched only with --allow-image-urls; send a data: URL", param)
    raise bad("expected a data: URL (or http(s) with --allow-image-urls)", param)


def fetch(url: str, param: str) -> str:
    """An http(s) image URL fetched (at most MAX_IMAGE_BYTES, FETCH_SECONDS in all) as a
    data: URL."""
    deadline = time.monotonic() + FETCH_SECONDS
    try:
        with _OPENER.open(url, timeout=FETCH_SECONDS) as r:  # http(s) only, no proxies
            chunks, size = [], 0
            while chunk := r.read1(1 << 16):  # what has arrived: the deadline checked often
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise bad(f"an image over {MAX_IMAGE_BYTES >> 20} MiB", param)
                if time.monotonic() > deadline:
                    raise bad(f"the image took over {FETCH_SECONDS:g} s to fetch", param)
                chunks.append(chunk)
            kind = r.headers.get_content_type() or "application/octet-stream"
    except APIError:
        raise
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise bad(f"the image could not be fetched: {e}", param) from None
    return data_url(kind, base64.b64encode(b"".join(chunks)).decode())
