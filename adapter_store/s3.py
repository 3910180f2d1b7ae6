"""`S3Backend`: the adapter store's objects in S3-compatible object storage (`--object-store`).

A PUT replaces a whole object atomically, so a reader never sees a torn object; the catalog's
ordering (data objects first, the metadata object last) makes a registration atomic as a whole.
Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile,
an instance role); `--object-store-endpoint` points it at MinIO, Ceph, R2 or a test server.
Quarantine is a copy under `<prefix>/quarantine/` and a delete. Unlike a data dir there is no
lock: run one store per bucket prefix.

boto3 is imported here only, so a store with a data dir does not need it (`pip install loraserve[s3]`).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from loraserve.adapter_store.persistence import QUARANTINE, StorageConfigError, check_key
from loraserve.errors import LoraserveError, ResourceExhaustedError, UnavailableError

log = logging.getLogger(__name__)


def parse_s3_url(url: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix' -> ('bucket', 'some/prefix'); the prefix may be empty."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
        raise StorageConfigError(f"object store {url!r}: expected s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = parsed.path.strip("/")
    if prefix:
        check_key(prefix)
    return parsed.netloc, prefix


class S3Backend:
    def __init__(self, url: str, endpoint_url: str | None = None, client: Any = None):
        self.bucket, self.prefix = parse_s3_url(url)
        self.location = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        if client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise StorageConfigError(
                    "--object-store needs boto3: pip install 'loraserve[s3]' (or boto3 itself)"
                ) from None
            config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60)
            try:
                client = boto3.client("s3", endpoint_url=endpoint_url, config=config)
            except Exception as e:  # a malformed endpoint URL, no region, a broken profile
                raise StorageConfigError(f"object store {self.location}: {_describe(e)}") from None
        self._s3 = client
        self._check_reachable()

    # ---- the interface ---------------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self._call("write", self._s3.put_object, Bucket=self.bucket, Key=self._key(key), Body=bytes(data))

    def get(self, key: str) -> bytes:
        try:
            reply = self._s3.get_object(Bucket=self.bucket, Key=self._key(key))
            return reply["Body"].read()
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                raise KeyError(key) from None
            raise _storage_error("read", self.location, e) from e

    def delete(self, key: str) -> None:
        self._call("write", self._s3.delete_object, Bucket=self.bucket, Key=self._key(key))

    def list_keys(self, under: str = "") -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        found = []
        listed = f"{self._key(under)}/" if under else base
        try:
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=listed):
                found += [item["Key"][len(base) :] for item in page.get("Contents", [])]
        except Exception as e:
            raise _storage_error("list", self.location, e) from e
        visible = (k for k in found if k and not k.startswith(f"{QUARANTINE}/"))
        return sorted(k for k in visible if not any(part.startswith(".") for part in k.split("/")))

    def quarantine(self, key: str, to: str) -> None:
        source = {"Bucket": self.bucket, "Key": self._key(key)}
        target = self._key(f"{QUARANTINE}/{to}")
        self._call("write", self._s3.copy_object, Bucket=self.bucket, Key=target, CopySource=source)
        self.delete(key)

    def close(self) -> None:
        self._s3.close()

    # ---- internals -------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, method, **kwargs) -> Any:
        try:
            return method(**kwargs)
        except Exception as e:
            raise _storage_error(what, self.location, e) from e

    def _check_reachable(self) -> None:
        """Fail at start-up, with the reason, when the bucket is missing, unreachable or not writable."""
        probe = f"{self.prefix}/.probe" if self.prefix else ".probe"  # hidden: never listed by list_keys()
        try:
            self._s3.head_bucket(Bucket=self.bucket)
            self._s3.put_object(Bucket=self.bucket, Key=probe, Body=b"")
            self._s3.delete_object(Bucket=self.bucket, Key=probe)
        except Exception as e:
            raise StorageConfigError(f"object store {self.location} cannot be used: {_describe(e)}") from None


def _code(e: Exception) -> str:
    response = getattr(e, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _describe(e: Exception) -> str:
    code = _code(e)
    return f"{code}: {e}" if code else f"{type(e).__name__}: {e}"


def _storage_error(what: str, location: str, e: Exception) -> LoraserveError:
    if _code(e) in ("EntityTooLarge", "QuotaExceeded", "InsufficientStorage"):
        return ResourceExhaustedError(f"the adapter store's object store {location} is full: {_describe(e)}")
    return UnavailableError(f"the adapter store could not {what} {location}: {_describe(e)}")
