"""A moto S3 server on 127.0.0.1 that checks SigV4 signatures, shared by the S3 tests and the
store latency benchmark: an IAM user with a full-access key, one bucket, and from then on every
request must be signed with that key."""
import json
import logging
import types
import uuid


def _use_aws_like_continuation_tokens():
    """moto's continuation tokens are hex digests; AWS's are base64 with '+', '/' and '='. Makes
    moto hand out tokens with those characters, so a listing that encodes them wrongly for SigV4
    fails its signature check. Returns the function that undoes it."""
    import base64

    from moto.s3.models import S3Backend

    original = S3Backend._truncate_result

    def truncate(self, result_keys, max_keys):
        keys, truncated, token = original(self, result_keys, max_keys)
        if token:
            aws_like = "1+/" + base64.b64encode(bytes.fromhex(token) + b"\xfb\xff").decode() + "=="
            self._pagination_tokens[aws_like] = self._pagination_tokens[token]
            token = aws_like
        return keys, truncated, token

    S3Backend._truncate_result = truncate
    return lambda: setattr(S3Backend, "_truncate_result", original)


def start_signed_moto(bucket: str, user: str = "deltasync", aws_like_tokens: bool = False):
    """Starts the server; returns a namespace with endpoint, host, port, key_id, secret, env (the
    AWS_* variables the C++ S3 store reads) and stop() (which also restores moto's settings).
    aws_like_tokens: listing continuation tokens contain '+', '/' and '=' as AWS's do."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    # moto keeps its accounts in process-wide memory shared by every server it starts, so each
    # start makes a user of its own.
    user = f"{user}-{uuid.uuid4().hex[:8]}"
    import boto3
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    setup = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup", aws_secret_access_key="setup")
    iam = boto3.client("iam", **setup)
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    boto3.client("s3", **setup).create_bucket(Bucket=bucket)
    # From here on every request must carry a valid SigV4 signature of the user's key.
    previous = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    ActionAuthenticatorMixin.request_count = 0

    undo_tokens = _use_aws_like_continuation_tokens() if aws_like_tokens else (lambda: None)

    def stop():
        settings.INITIAL_NO_AUTH_ACTION_COUNT = previous
        undo_tokens()
        server.stop()

    env = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    return types.SimpleNamespace(endpoint=endpoint, host=host, port=port, key_id=key["AccessKeyId"],
                                 secret=key["SecretAccessKey"], env=env, stop=stop)
