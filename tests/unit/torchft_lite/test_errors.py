"""The exception tree: each error is also what torchft raises in the same situation."""

import pickle
import urllib.error

import pytest

from torchft_lite import errors
from torchft_lite.errors import (
    CheckpointError, CheckpointHTTPError, CheckpointTimeout, CheckpointTransferError, CheckpointURLError,
    CheckpointURLTimeout, CollectiveError, CollectiveTimeout, ConfigError, ManagerError, ManagerTimeout, QuorumError,
    QuorumTimeout, TorchFTError,
)


@pytest.mark.parametrize("cls", [QuorumError, CollectiveError, CheckpointError, CheckpointTransferError,
                                 ManagerError, CheckpointURLError])
def test_failures_are_runtime_errors_as_in_torchft(cls):
    error = cls("broke")
    assert isinstance(error, TorchFTError) and isinstance(error, RuntimeError)
    assert not isinstance(error, TimeoutError)


@pytest.mark.parametrize("cls, parent", [(QuorumTimeout, QuorumError), (CollectiveTimeout, CollectiveError),
                                         (CheckpointTimeout, CheckpointTransferError),
                                         (ManagerTimeout, ManagerError), (CheckpointURLTimeout, CheckpointTimeout)])
def test_timeouts_are_timeout_errors_and_runtime_errors(cls, parent):
    error = cls("timed out after 1.0s waiting for x")
    assert isinstance(error, parent) and isinstance(error, TimeoutError) and isinstance(error, RuntimeError)
    with pytest.raises(RuntimeError, match="timed out"):
        raise error


def test_config_error_is_a_value_error_not_a_runtime_error():
    assert isinstance(ConfigError("x"), ValueError) and not isinstance(ConfigError("x"), RuntimeError)


def test_an_http_receive_failure_is_a_urllib_url_error():
    error = CheckpointURLError("receiving step 3 from http://h:1/checkpoint failed: connection refused")
    assert isinstance(error, urllib.error.URLError) and isinstance(error, OSError)
    assert error.reason == error.args[0]
    assert str(error) == "<urlopen error receiving step 3 from http://h:1/checkpoint failed: connection refused>"


def test_an_http_receive_timeout_is_both_a_url_error_and_a_checkpoint_timeout():
    error = CheckpointURLTimeout("timed out after 0.0s receiving step 3")
    assert isinstance(error, urllib.error.URLError) and isinstance(error, CheckpointTimeout)
    assert "urlopen error" in str(error) and "timed out" in str(error)


def test_an_error_status_is_a_urllib_http_error_with_its_code_and_body():
    error = CheckpointHTTPError("http://h:1/checkpoint/3", 400, "serving 4 but got step=3", b"the body")
    assert isinstance(error, urllib.error.HTTPError) and isinstance(error, CheckpointTransferError)
    assert not isinstance(error, TimeoutError)
    assert error.code == 400 and error.url == "http://h:1/checkpoint/3" and error.read() == b"the body"
    assert str(error) == "HTTP Error 400: serving 4 but got step=3"
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.code, str(copy), copy.read()) == (CheckpointHTTPError, 400, str(error), b"the body")


def test_every_public_error_is_drawn_in_the_tree():
    for name in errors.__all__:
        assert name in errors.__doc__, name
