"""MediaLoader: an image_url string -> the image's encoded bytes, within the operator's rules.

A server must not fetch or read what a client names unless its operator said so: data URLs
are always taken (the bytes are in the request), local files only under
--allowed-local-media-path (resolved, so no symlink or `..` leaves it), http(s) only from
hosts in --allowed-media-domains (redirects too), with a timeout and a byte cap. Every
refusal is a ValueError naming the problem. Blocking: callers run it off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class MediaLoader:
    max_bytes: int  # an image's encoded size, at most (0: no bound)
    local_root: Path | None = None  # --allowed-local-media-path, resolved (None: no files)
    domains: frozenset[str] = frozenset()  # --allowed-media-domains, lower case
    timeout_s: float = 5.0  # one http(s) fetch, whole

    @classmethod
    def of(cls, config) -> MediaLoader:
        """The loader a FrontendConfig describes."""
        root = config.allowed_local_media_path
        return cls(
            max_bytes=config.max_image_bytes,
            local_root=Path(root).resolve() if root else None,
            domains=frozenset(d.lower() for d in config.allowed_media_domains),
            timeout_s=config.media_fetch_timeout_s,
        )

    def load(self, url: str) -> bytes:
        """The bytes `url` names (ValueError naming why not)."""
        if not isinstance(url, str) or not url:
            raise ValueError("image_url must be a non-empty string (a data URL or a URL).")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url)
        if scheme in ("http", "https"):
            return self._fetch(url)
        if scheme == "file" or url.startswith("/"):
            return self._local_file(url)
        raise ValueError(
            f"image_url: the scheme {scheme or url[:16]!r} is not supported; send a data URL "
            "(data:image/png;base64,...), an http(s) URL or a file the server allows."
        )

    def _data_url(self, url: str) -> bytes:
        header, comma, payload = url[5:].partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise ValueError("image_url: a data URL must be data:image/<format>;base64,<data>.")
        media_type = header[: -len(";base64")].lower()
        if not media_type.startswith("image/"):
            raise ValueError(f"image_url: the data URL's media type {media_type!r} is not image/*.")
        self.check_size(len(payload) // 4 * 3, "the data URL's image")  # before decoding
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"image_url: the data URL's base64 is not valid: {exc}") from None

    def _local_file(self, url: str) -> bytes:
        if self.local_root is None:
            raise ValueError(
                "image_url: this server reads no local files (its operator can allow a "
                "folder with --allowed-local-media-path)."
            )
        raw = url
        if url.startswith("file:"):
            raw = urllib.parse.unquote(urllib.parse.urlparse(url).path)
        try:
            path = Path(raw).resolve(strict=True)  # symlinks followed: the real place counts
        except (OSError, RuntimeError):
            raise ValueError(f"image_url: no such file {raw!r}.") from None
        if not path.is_relative_to(self.local_root) or not path.is_file():
            raise ValueError(
                f"image_url: {raw!r} is not a file under the allowed media folder "
                "(--allowed-local-media-path)."
            )
        self.check_size(path.stat().st_size, f"the file {raw!r}")
        with path.open("rb") as f:
            data = f.read(self.max_bytes + 1 if self.max_bytes else -1)
        self.check_size(len(data), f"the file {raw!r}")
        return data

    def _fetch(self, url: str) -> bytes:
        self.check_host(url)
        opener = urllib.request.build_opener(_AllowListRedirects(self))
        deadline = time.monotonic() + self.timeout_s
        try:
            with opener.open(url, timeout=self.timeout_s) as response:
                return self._read(response, url, deadline)
        except urllib.error.HTTPError as exc:
            raise ValueError(f"image_url: fetching {url!r} failed: HTTP {exc.code}.") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ValueError(f"image_url: fetching {url!r} failed: {reason}") from None

    def _read(self, response, url: str, deadline: float) -> bytes:
        """The body, in chunks: at most max_bytes, and all of it before the deadline (a
        server that drips a byte at a time cannot hold a thread past the timeout)."""
        chunks, size = [], 0
        while chunk := response.read(READ_CHUNK):
            size += len(chunk)
            self.check_size(size, f"the image at {url!r}")
            if time.monotonic() > deadline:
                raise ValueError(f"image_url: fetching {url!r} took over {self.timeout_s} s.")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_host(self, url: str) -> None:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if host not in self.domains:
            raise ValueError(
                f"image_url: this server fetches no images from {host or url!r} (its operator "
                "can allow hosts with --allowed-media-domains); send the image as a data URL."
            )

    def check_size(self, size: int, what: str) -> None:
        if self.max_bytes and size > self.max_bytes:
            raise ValueError(
                f"image_url: {what} is over {self.max_bytes} bytes (--max-image-bytes)."
            )


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host (else the allow-list could be left)."""

    def __init__(self, loader: MediaLoader) -> None:
        self.loader = loader

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlparse(newurl).scheme not in ("http", "https"):
            raise ValueError(f"image_url: a redirect to {newurl!r} is not followed.")
        self.loader.check_host(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
