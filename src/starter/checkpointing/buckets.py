"""The object stores `checkpoint_store` reaches, each behind the same few calls (checkpointing/store.py holds what
is uploaded and believed): s3:// through boto3 (AWS's credential chain; an S3-compatible store at AWS_ENDPOINT_URL),
gs:// through gcsfs (Google's default credentials; an emulator at STORAGE_EMULATOR_HOST), az://container/prefix through
azure-storage-blob (Azure's variables: a connection string, or an account with its key, a SAS token or an identity).
Each says in one line why a call failed (`why`)."""

import os
import shutil
from collections.abc import Iterator
from typing import BinaryIO

from starter.errors import UserError, first_line

REFUSED = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")  # S3's "not you"
CHUNK = 1 << 20


class S3:
    kind = "bucket"

    def __init__(self, bucket: str, url: str):
        try:
            import boto3
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise UserError(f"checkpoint_store={url} needs boto3: pip install -e '.[store]'") from None
        self.bucket, self.errors = bucket, (BotoCoreError, ClientError)
        self.client = boto3.session.Session().client("s3")  # the environment as it is now

    def exists(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchBucket", "404"):
                return False
            raise
        return True

    def get(self, key: str) -> tuple[int, Iterator[bytes]] | None:
        """(its size, its bytes in chunks), or None where there is no such object."""
        from botocore.exceptions import ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise
        return answer["ContentLength"], answer["Body"].iter_chunks(CHUNK)

    def put(self, key: str, body: bytes | BinaryIO) -> None:
        """The object `key` made of `body` (a file read from where it is), whole or not at all."""
        if isinstance(body, bytes):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
        else:
            self.client.upload_fileobj(body, self.bucket, key)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def why(self, err: Exception) -> str:
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        if isinstance(err, EndpointConnectionError):
            return f"its endpoint {self.where} does not answer; check AWS_ENDPOINT_URL and the network"
        if isinstance(err, NoCredentialsError):
            return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, an instance role)"
        if isinstance(err, ClientError) and err.response["Error"]["Code"] in REFUSED:
            return f"{self.where} refuses these credentials ({err.response['Error']['Code']}); check AWS_ACCESS_KEY_ID"
        return first_line(err)

    @property
    def where(self) -> str:
        return self.client.meta.endpoint_url


class GCS:
    kind = "bucket"

    def __init__(self, bucket: str, url: str):
        try:
            from gcsfs.core import GCSFileSystem  # the plain one: no probe of the bucket's kind over gRPC
            from gcsfs.retry import HttpError
            from google.auth.exceptions import GoogleAuthError
        except ImportError:
            raise UserError(f"checkpoint_store={url} needs gcsfs: pip install -e '.[store]'") from None
        self.bucket, self.errors = bucket, (OSError, ValueError, HttpError, GoogleAuthError)
        self.fs = GCSFileSystem(skip_instance_cache=True)  # the environment as it is now
        self.where = self.fs._location

    def exists(self) -> bool:
        return self.fs.exists(self.bucket)

    def get(self, key: str) -> tuple[int, Iterator[bytes]] | None:
        try:
            file = self.fs.open(f"{self.bucket}/{key}", "rb")
        except FileNotFoundError:
            return None

        def chunks() -> Iterator[bytes]:
            with file:
                while chunk := file.read(CHUNK):
                    yield chunk

        return file.size, chunks()

    def put(self, key: str, body: bytes | BinaryIO) -> None:
        if isinstance(body, bytes):
            self.fs.pipe_file(f"{self.bucket}/{key}", body)
            return
        out = self.fs.open(f"{self.bucket}/{key}", "wb")
        try:
            shutil.copyfileobj(body, out, CHUNK)
        except BaseException:
            out.discard()  # never committed: closing would make an object of what was sent so far
            raise
        out.close()

    def delete(self, key: str) -> None:
        self.fs.rm_file(f"{self.bucket}/{key}")

    def why(self, err: Exception) -> str:
        from google.auth.exceptions import GoogleAuthError

        if isinstance(err, ConnectionError) or type(err).__name__.startswith("ClientConnector"):
            return f"its endpoint {self.where} does not answer; check STORAGE_EMULATOR_HOST and the network"
        if isinstance(err, GoogleAuthError) or "Forbidden" in str(err) or getattr(err, "code", None) in (401, 403):
            return (
                f"{self.where} refuses these credentials ({first_line(err)}); check GOOGLE_APPLICATION_CREDENTIALS"
                " (or `gcloud auth application-default login`)"
            )
        return first_line(err)


AZURE_CREDENTIALS = (
    "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY,"
    " AZURE_STORAGE_SAS_TOKEN or an identity Azure's DefaultAzureCredential finds (AZURE_CLIENT_ID..., a managed one)"
)


class AzureBlob:
    """az://container/prefix: the account, its endpoint and credentials from Azure's variables, as az and adlfs read
    them."""

    kind = "container"

    def __init__(self, container: str, url: str):
        try:
            from azure.core.exceptions import AzureError
            from azure.storage.blob import ContainerClient
        except ImportError:
            raise UserError(f"checkpoint_store={url} needs azure-storage-blob: pip install -e '.[store]'") from None
        self.errors = (AzureError, OSError, ValueError)
        env = os.environ  # the environment as it is now
        if connection := env.get("AZURE_STORAGE_CONNECTION_STRING"):
            self.container = ContainerClient.from_connection_string(connection, container)
        elif account := env.get("AZURE_STORAGE_ACCOUNT_NAME"):
            credential = env.get("AZURE_STORAGE_ACCOUNT_KEY") or env.get("AZURE_STORAGE_SAS_TOKEN")
            if credential is None:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError:
                    raise UserError(f"checkpoint_store={url} needs azure-identity: pip install -e '.[store]'") from None
                credential = DefaultAzureCredential()
            self.container = ContainerClient(f"https://{account}.blob.core.windows.net", container, credential)
        else:
            raise UserError(f"checkpoint_store={url}: no Azure storage account: {AZURE_CREDENTIALS}")
        self.where = self.container.url.rsplit("/", 1)[0]

    def exists(self) -> bool:
        """The first call: an endpoint that does not answer is said now, not after the SDK's minute of retries."""
        return self.container.exists(retry_connect=0)

    def get(self, key: str) -> tuple[int, Iterator[bytes]] | None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            download = self.container.download_blob(key)
        except ResourceNotFoundError:
            return None
        return download.size, download.chunks()

    def put(self, key: str, body: bytes | BinaryIO) -> None:
        """A stream is sent in blocks, committed as the blob in one call once all are there: cut short, no blob."""
        self.container.upload_blob(key, body, overwrite=True, max_concurrency=1)

    def delete(self, key: str) -> None:
        self.container.delete_blob(key)

    def why(self, err: Exception) -> str:
        from azure.core.exceptions import ClientAuthenticationError, ServiceRequestError

        if isinstance(err, ServiceRequestError):
            return f"its endpoint {self.where} does not answer; check AZURE_STORAGE_CONNECTION_STRING and the network"
        if isinstance(err, ClientAuthenticationError) or getattr(err, "status_code", None) in (401, 403):
            code = getattr(err, "error_code", None)
            code = getattr(code, "value", code) or first_line(err)  # an enum of the SDK's, or its string
            return (
                f"{self.where} refuses these credentials ({code}); check AZURE_STORAGE_CONNECTION_STRING, or"
                " AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN / the identity"
            )
        return first_line(err)


SCHEMES = {"s3": S3, "gs": GCS, "az": AzureBlob}
