"""EngineConfig's messages say what to do: an unknown field name gets the closest valid
one, and every invalid value names its field, before any engine starts."""

from __future__ import annotations

import pytest

from shmclient.config import EngineConfig, UnknownFieldError
from shmclient.errors import ConfigError


@pytest.mark.parametrize("typo,meant", [
    ("ring_capacity", "ring_capacity_bytes"), ("max_num_seq", "max_num_seqs"),
    ("spinus", "spin_us"), ("utility_module", "utility_modules"), ("devices", "device"),
])
def test_an_unknown_field_names_the_closest_one(typo, meant):
    with pytest.raises(UnknownFieldError) as info:
        EngineConfig(**{typo: 1})
    assert f"no field {typo!r}" in str(info.value) and f"did you mean {meant!r}" in str(info.value)
    # a TypeError, as Python says of an unknown keyword, and a ConfigError, as ours say
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    with pytest.raises(UnknownFieldError, match=f"did you mean {meant!r}"):
        EngineConfig().replace(**{typo: 1})


def test_an_unknown_field_with_nothing_close_lists_the_fields():
    with pytest.raises(UnknownFieldError) as info:
        EngineConfig(bogus=1)
    text = str(info.value)
    assert "no field 'bogus'" in text and "ring_capacity_bytes" in text and "model" in text


def test_positional_arguments_keep_msgspecs_message():
    with pytest.raises(TypeError) as info:
        EngineConfig("tiny")  # type: ignore[misc]
    assert not isinstance(info.value, UnknownFieldError)


def test_a_ring_capacity_the_ring_refuses_is_refused_by_the_config_naming_the_field():
    # The ring takes multiples of 8 up to 1 TiB; these used to pass the config and fail
    # in the ring, with a message that named no field.
    for bad in (5001, 4097, (1 << 40) + 8):
        with pytest.raises(ConfigError, match=f"ring_capacity_bytes={bad}"):
            EngineConfig(ring_capacity_bytes=bad)
    assert EngineConfig(ring_capacity_bytes=5000).ring_capacity_bytes == 5000


WEIRD = [None, "x", -1, 0, 1.5, float("nan"), True, [1], {}, object(), 10**30, b"a", ("a",)]


def test_every_invalid_value_of_every_field_names_its_field():
    checked = 0
    for field in EngineConfig.__struct_fields__:
        for value in WEIRD:
            try:
                EngineConfig(**{field: value})
            except ConfigError as e:
                # its own field, or a pair (hidden_size=64 "must be a multiple of num_heads=7")
                assert f"{field}=" in str(e), (field, value, str(e))
                checked += 1
    assert checked > 300


@pytest.mark.parametrize("raw", ["nan", "-1", "0", "inf", "soon"])
def test_a_ready_timeout_variable_that_is_no_finite_positive_number_is_a_config_error(monkeypatch, raw):
    """NaN never ran out (a start-up polled without end), 0 and less gave up at once:
    the variable follows the config field's rule."""
    from shmclient.handshake import READY_TIMEOUT_ENV, ready_timeout_s

    monkeypatch.setenv(READY_TIMEOUT_ENV, raw)
    with pytest.raises(ConfigError, match=READY_TIMEOUT_ENV):
        ready_timeout_s(EngineConfig())
    monkeypatch.setenv(READY_TIMEOUT_ENV, "2.5")
    assert ready_timeout_s(EngineConfig()) == 2.5


@pytest.mark.parametrize("raw", ["nan", "-1", "0", "inf", "soon"])
def test_a_remote_engine_reads_the_ready_timeout_variable_by_the_same_rule(monkeypatch, capsys, raw):
    """``python -m shmclient_engine --connect`` read the variable with a bare float():
    "soon" ended in a ValueError traceback, "inf" waited for a frontend for good, "nan"
    and "0" blamed an option the user did not give. A usage error naming the variable
    now; ``--ready-timeout`` itself must be finite too."""
    from shmclient.config import READY_TIMEOUT_ENV
    from shmclient.serve_remote import parse_argv

    monkeypatch.setenv(READY_TIMEOUT_ENV, raw)
    with pytest.raises(SystemExit):
        parse_argv(["--connect", "tcp://127.0.0.1:1"])
    assert READY_TIMEOUT_ENV in capsys.readouterr().err
    monkeypatch.setenv(READY_TIMEOUT_ENV, "2.5")
    assert parse_argv(["--connect", "tcp://127.0.0.1:1"])[2] == 2.5
    monkeypatch.delenv(READY_TIMEOUT_ENV)
    assert parse_argv(["--connect", "tcp://127.0.0.1:1"])[2] == 600.0
    with pytest.raises(SystemExit):
        parse_argv(["--connect", "tcp://127.0.0.1:1", "--ready-timeout", "inf"])
    assert "--ready-timeout inf" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["tcp://127.0.0.1", "tcp://host:notaport", "tcp://host:0",
                                     "tcp://host:65536", "tcp://:5000", "tcp://host:", "ipc:///tmp/x"])
def test_a_remote_engine_refuses_a_connect_address_without_host_and_port(capsys, address):
    """``--connect tcp://127.0.0.1`` (no port) or a port that is not a number ended in a
    pyzmq traceback once the engine connected: a usage error on the command line now."""
    from shmclient.serve_remote import parse_argv

    with pytest.raises(SystemExit) as ei:
        parse_argv(["--connect", address])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert f"--connect {address!r}" in err and "tcp://HOST:PORT" in err
    for good in ("tcp://127.0.0.1:1", "tcp://host.example:65535", "tcp://[::1]:5000"):
        assert parse_argv(["--connect", good])[0] == good


def test_other_bad_variables_are_config_errors_naming_them(monkeypatch, tmp_path):
    """Every error a client raises is a ShmClientError: the variables too."""
    from shmclient import capacity, control_sockets

    monkeypatch.setenv(capacity.MARGIN_ENV, "lots")
    with pytest.raises(ConfigError, match=capacity.MARGIN_ENV):
        capacity.margin_bytes()
    monkeypatch.setenv(control_sockets.IPC_DIR_ENV, str(tmp_path / "no such folder"))
    with pytest.raises(ConfigError, match=control_sockets.IPC_DIR_ENV):
        control_sockets.IpcDir()


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_an_ipc_folder_too_deep_for_a_unix_socket_is_named_not_the_dp_settings(monkeypatch, tmp_path, transport):
    """A local start where SHMCLIENT_IPC_DIR makes the control socket's path longer than a
    unix socket allows: the error blamed data_parallel_address / data_parallel_rpc_port,
    which were not set. It names the variable and the limit now."""
    from shmclient import SyncMPClient, control_sockets

    deep = tmp_path / ("x" * 100)
    deep.mkdir()
    monkeypatch.setenv(control_sockets.IPC_DIR_ENV, str(deep))
    with pytest.raises(ConfigError) as ei:
        SyncMPClient(EngineConfig(model="mock", transport=transport))
    text = str(ei.value)
    assert f"{control_sockets.IPC_DIR_ENV}={str(deep)!r}" in text and "unix socket's limit of 107" in text
    assert "data_parallel" not in text
    assert list(deep.iterdir()) == []  # (its private folder removed)


def test_a_secret_variable_of_bytes_that_are_not_utf8_is_used_as_it_is(monkeypatch):
    """A secret taken from random bytes (the environment holds bytes): the frontend and
    the engine both failed with UnicodeEncodeError."""
    import os

    from shmclient import auth

    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(auth.SECRET_ENV, os.fsdecode(b"\xa7\xffsecret"))
    assert auth.load_secret() == b"\xa7\xffsecret"


def test_a_secret_file_that_is_not_a_regular_file_is_refused_without_blocking(monkeypatch, tmp_path):
    """SHMCLIENT_SECRET_FILE naming a FIFO: reading it blocked the start-up until someone
    wrote to it. It is refused at once, naming the variable."""
    import os
    import threading

    from shmclient import auth
    from shmclient.errors import AuthenticationError

    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(fifo))
    got: list[object] = []

    def load():
        try:
            got.append(auth.load_secret())
        except AuthenticationError as e:
            got.append(e)

    t = threading.Thread(target=load)
    t.start()
    t.join(5)
    blocked = t.is_alive()
    if blocked:  # a writer that closes at once ends the read
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not blocked
    assert isinstance(got[0], AuthenticationError), got
    assert auth.SECRET_FILE_ENV in str(got[0]) and "not a regular file" in str(got[0])


def test_a_secret_file_is_read_up_to_a_bound_and_loses_one_line_ending(monkeypatch, tmp_path):
    """A file longer than MAX_SECRET_FILE_BYTES is refused (it was read whole, however
    large); exactly one trailing newline is dropped, any other CR / LF is the secret's."""
    from shmclient import auth
    from shmclient.errors import AuthenticationError

    path = tmp_path / "secret"
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(path))
    for text, secret in ((b"s\n", b"s"), (b"s\r\n", b"s"), (b"s\n\n", b"s\n"), (b"s\r\r\n", b"s\r"),
                         (b"s\r", b"s\r"), (b"s", b"s")):
        path.write_bytes(text)
        assert auth.load_secret() == secret, text
    monkeypatch.setattr(auth, "MAX_SECRET_FILE_BYTES", 16)
    path.write_bytes(b"x" * 16)
    assert auth.load_secret() == b"x" * 16
    path.write_bytes(b"x" * 17)
    with pytest.raises(AuthenticationError, match=f"{auth.SECRET_FILE_ENV}=.* longer than 16 bytes"):
        auth.load_secret()


def test_a_timeout_past_the_largest_float_is_no_limit():
    from shmclient.validate import check_timeout

    assert check_timeout("get_output", 10**400) == float("inf")
