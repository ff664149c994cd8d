"""litdata's S3 reader and writer, able to reach an endpoint over plain HTTP (an on-premise MinIO, a test's local
server). litdata moves chunks with obstore, whose S3 store refuses `http://` unless told `allow_http`, and litdata
builds that store with client options of its own (the environment's AWS_ALLOW_HTTP is then not read). For an http://
endpoint we build the store ourselves, with the endpoint of litdata's own boto3 client and the standard AWS
credentials, and hand it to litdata through its downloader registry; uploads there go through that boto3 client (an
obstore runtime started in make_shards' process would not survive the fork of its next writer processes). An
https:// endpoint, or none (AWS), is litdata's own path, untouched. A chunk that cannot be fetched (after the store
client's retries) is an error of one line naming the object, whatever the endpoint: litdata prints the exception its
prefetch thread dies of, and obstore's run over a hundred lines. Our store tries a fetch as often as the standard AWS
setting says (AWS_MAX_ATTEMPTS, or max_attempts in ~/.aws/config), where one is set; else as obstore does: 11 times
in up to 3 min (litdata's own boto3 client ignores the setting: 1,000 attempts)."""

import asyncio
import os
from urllib.parse import urlparse

from starter.data.shard_set import INDEX, check_index
from starter.errors import first_line


class ChunkUnreadable(Exception):
    """A chunk the store did not give (after its client's own retries)."""


def use_plain_http_endpoints() -> None:
    """litdata's s3:// reads and writes in this process, and those forked from it, through S3Downloader below."""
    from litdata.streaming.downloader import register_downloader

    register_downloader("s3://", _downloader_class(), overwrite=True)


def _downloader_class():
    from litdata.streaming.downloader import S3Downloader as LitdataS3Downloader

    class S3Downloader(LitdataS3Downloader):
        def download_file(self, remote_filepath: str, local_filepath: str) -> None:
            """Also refuses the index litdata then reads if it is not one make_shards.py writes, whatever it was
            when the run began (a store's file can change between two reads)."""
            try:
                super().download_file(remote_filepath, local_filepath)
            except FileNotFoundError:
                raise
            except Exception as err:
                raise ChunkUnreadable(f"{remote_filepath}: {first_line(err)}") from None
            if os.path.basename(local_filepath) == INDEX:
                with open(local_filepath) as index:
                    check_index(remote_filepath, index.read())

        def _plain_http(self) -> str | None:
            endpoint = self._client.client.meta.endpoint_url or ""  # as litdata's boto3 client read AWS_ENDPOINT_URL
            return endpoint if endpoint.startswith("http://") else None

        def _get_store(self, bucket: str):
            if (endpoint := self._plain_http()) is None:
                return super()._get_store(bucket)
            key = (os.getpid(), bucket)  # obstore's runtime does not survive a fork: a store per process
            if getattr(self, "_plain_http_store", (None, None))[0] != key:
                import boto3
                import botocore.session
                from obstore.store import S3Store

                credentials = boto3.Session().get_credentials().get_frozen_credentials()  # the standard AWS chain
                token = {"token": credentials.token} if credentials.token else {}
                region = self._client.client.meta.region_name or "us-east-1"
                attempts = botocore.session.get_session().get_config_variable("max_attempts")
                retry = {"retry_config": {"max_retries": max(attempts - 1, 0)}} if attempts is not None else {}
                store = S3Store(
                    bucket,
                    endpoint=endpoint,
                    virtual_hosted_style_request=False,
                    region=region,
                    access_key_id=credentials.access_key,
                    secret_access_key=credentials.secret_key,
                    **token,
                    client_options={"allow_http": True, "timeout": "200s"},
                    **retry,
                )
                self._plain_http_store = (key, store)
            return self._plain_http_store[1]

        async def aupload_file(self, local_filepath: str, remote_filepath: str) -> None:
            if self._plain_http() is None:
                return await super().aupload_file(local_filepath, remote_filepath)
            target = urlparse(remote_filepath)
            upload = self._client.client.upload_file
            await asyncio.to_thread(upload, local_filepath, target.netloc, target.path.lstrip("/"))

    return S3Downloader
